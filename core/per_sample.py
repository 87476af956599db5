"""Per-sample LoRA gradients, and every per-reward gradient from two backward passes (whatever K).

Per sample i the NFT policy loss is affine in the optimality weight (core/loss.py):
ℓ_{k,i} = c·(r_{k,i}·L⁺_i + (1 − r_{k,i})·L⁻_i), c = A_max/β, and L± are shared by all K rewards. With
p_i = ∇L⁺_i, q_i = ∇L⁻_i (per-sample gradients of the trainable LoRA parameters, flat [P]) and
J = [p_1 … p_b, q_1 … q_b] ([2b, P]), the masked per-reward gradients are

    g_k = Σ_i (m_{k,i}/n_k)·c·(r_{k,i}·p_i + (1 − r_{k,i})·q_i) = (W J)_k,     W [K, 2b]   (reward_mixing)

so the Gram matrix is G = W (J Jᵀ) Wᵀ and any combined direction Σ_k c_k g_k = (cᵀW) J. Samples do not
interact inside the transformer (attention mixes tokens of one sample, normalizations are per sample),
so one backward pass of Σ_i L⁺_i gives every p_i and one of Σ_i L⁻_i every q_i: a LoRA linear's weight
gradient is Σ_tokens grad_outputᵀ·input, and keeping the sample axis instead of summing it is that
sample's gradient. ``PerSampleGradients`` records each trainable linear's input on v_θ's forward and
folds its output gradient into J as the backward reaches it, so the per-token activations' gradients
are never kept past their layer.

Cost: 2 backward passes instead of K (plus the KL's, as on the K-backward path) and J's memory,
2b × P floats (``jacobian_bytes``); the trainer falls back to K backward passes when J would not fit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from core.loss import nft_policy_loss


def reward_mixing(r: torch.Tensor, nft_beta: float, adv_clip_max: float) -> torch.Tensor:
    """W [K, 2b] with g_k = W_k · J for J = [p_1 … p_b, q_1 … q_b] (the module docstring).

    W[k, i] = c·m_{k,i}·r_{k,i}/n_k and W[k, b + i] = c·m_{k,i}·(1 − r_{k,i})/n_k, with m the validity mask
    (r NaN = the reward does not apply), n_k the valid count (a reward with none gets a zero row, as
    ``per_reward_objectives`` gives it a zero gradient). Shapes: r [b, K] -> [K, 2b]."""
    valid = torch.isfinite(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    counts = valid.sum(dim=0).clamp(min=1).to(r.dtype)
    w = valid.to(r.dtype) / counts[None, :]  # [b, K] m/n
    ones = torch.ones_like(r0)
    # nft_policy_loss is c·(r·L⁺ + (1 − r)·L⁻): its value at (L⁺, L⁻) = (1, 0) and (0, 1) is each weight.
    w_pos = w * nft_policy_loss(ones, torch.zeros_like(r0), r0, nft_beta, adv_clip_max)
    w_neg = w * nft_policy_loss(torch.zeros_like(r0), ones, r0, nft_beta, adv_clip_max)
    return torch.cat([w_pos, w_neg], dim=0).T.contiguous()


def jacobian_bytes(batch: int, num_params: int, dtype: torch.dtype = torch.float32) -> int:
    """Memory of one unit's J: 2·batch rows of num_params floats."""
    return 2 * batch * num_params * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a unit's J now: the CUDA device's free memory, or the host's MemAvailable (None when
    unknown, e.g. not Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PerSampleGradients:
    """Records per-sample gradients of ``params`` (LoRA weights of ``torch.nn.Linear`` layers of ``module``).

    Use::

        psg = PerSampleGradients(transformer, params)
        with psg.recording(batch=b, passes=2):       # the forward: each trainable linear's input is kept
            v = policy.velocity(inputs)
        l_pos, l_neg = ...
        psg.backward(l_pos.sum(), pass_index=0)      # row block 0 of J: every p_i
        psg.backward(l_neg.sum(), pass_index=1)      # row block 1: every q_i
        J = psg.jacobian                             # [passes·b, P], columns in ``params`` order
        psg.release()                                # drop J and the kept inputs

    The flat layout matches ``torch.cat([p.flatten() for p in params])``. Only linears whose weight is in
    ``params`` (and no bias among ``params``) are supported: LoRA's A and B matrices. Other backward passes
    through the same graph (the KL's, an update's) leave J alone. Under gradient checkpointing a block's
    forward runs again inside the backward; the kept input is then the recomputed one, the same values."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter]):
        ids = {id(p): n for n, p in enumerate(params)}
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        self.num_params = total
        self._layers: dict[torch.nn.Module, tuple[int, int]] = {}  # linear -> (offset, numel) of its weight
        found = set()
        for m in module.modules():
            if isinstance(m, torch.nn.Linear) and id(m.weight) in ids:
                if m.bias is not None and id(m.bias) in ids:
                    raise ValueError("per-sample gradients: a trainable bias is not supported (LoRA has none)")
                n = ids[id(m.weight)]
                self._layers[m] = (offsets[n], params[n].numel())
                found.add(n)
        missing = [n for n in range(len(params)) if n not in found]
        if missing:
            raise ValueError(f"per-sample gradients: {len(missing)} trainable tensors are not the weight of a "
                             f"linear layer (first: shape {tuple(params[missing[0]].shape)}); use the "
                             f"K-backward path")
        self._inputs: dict[torch.nn.Module, torch.Tensor] = {}
        # every recorded layer's output, by id, held weakly: a LoRA B output ([b, tokens, out]) must not outlive
        # its use for this bookkeeping (on SD3.5 they would add up to gigabytes); the ref tells a reused id apart
        self._outputs: dict[int, weakref.ref] = {}
        self._roots: list[torch.Tensor] = []  # those whose layer's input is no recorded output (LoRA's A)
        self._handles: list = []
        self._batch = 0
        self._pass: int | None = None  # the row block being filled; None outside ``backward``
        self.jacobian: torch.Tensor | None = None

    # -- recording --
    def recording(self, batch: int, passes: int = 2, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> "PerSampleGradients":
        """Arm for one forward of ``batch`` samples (a context manager) and allocate J [passes·b, P]."""
        self.release()
        self._batch = batch
        self.jacobian = torch.zeros(passes * batch, self.num_params, dtype=dtype, device=device)
        return self

    def __enter__(self) -> "PerSampleGradients":
        for layer in self._layers:
            self._handles.append(layer.register_forward_hook(self._on_forward))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def release(self) -> None:
        self._inputs.clear()
        self._outputs.clear()
        self._roots.clear()
        self.jacobian = None

    def _on_forward(self, layer: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and output.requires_grad):
            return  # v_old (functional_call under no_grad) runs through the same layers: not recorded
        x = args[0]
        if self.jacobian is None or x.shape[0] != self._batch:
            raise ValueError(f"per-sample gradients: a trainable layer saw a batch of {x.shape[0]} while "
                             f"{self._batch} samples are recorded")
        fed_by = self._outputs.get(id(x))
        if fed_by is None or fed_by() is not x:  # a root (LoRA's A), not fed by another recorded layer
            self._roots.append(output)
        self._outputs[id(output)] = weakref.ref(output)
        self._inputs[layer] = x.detach()
        output.register_hook(lambda grad, layer=layer: self._on_grad(layer, grad))

    def _on_grad(self, layer: torch.nn.Module, grad_out: torch.Tensor) -> None:
        if self._pass is None or self.jacobian is None:
            return  # another backward through the same graph (KL, an update's): not a row of J
        x = self._inputs[layer]
        b = self._batch
        # [b, tokens, out] x [b, tokens, in] -> [b, out, in]: this layer's weight gradient, one per sample
        per_sample = torch.einsum("bto,bti->boi", grad_out.reshape(b, -1, grad_out.shape[-1]).to(self.jacobian.dtype),
                                  x.reshape(b, -1, x.shape[-1]).to(self.jacobian.dtype))
        offset, numel = self._layers[layer]
        rows = self.jacobian[self._pass * b:(self._pass + 1) * b, offset:offset + numel]
        rows += per_sample.reshape(b, numel)  # += : a layer called twice in one forward adds both calls

    def backward(self, total: torch.Tensor, pass_index: int, retain_graph: bool = True) -> None:
        """One backward pass of ``total`` (a sum over the recorded samples of a per-sample loss): fills J's row
        block ``pass_index``. The pass stops at the recorded root layers' outputs (LoRA's A: [b, tokens, r],
        small): it reaches every recorded layer without computing the parameters' summed gradients, which the
        rows hold anyway."""
        if not self._roots:  # e.g. a forward outside ``recording``: J would be silently zero
            raise RuntimeError("per-sample gradients: no recorded forward of the trainable layers; record v_θ's "
                               "forward with ``recording``, or use balance.gradients=per_reward")
        self._pass = pass_index
        try:
            grads = torch.autograd.grad(total, self._roots, retain_graph=retain_graph, allow_unused=True)
        finally:
            self._pass = None
        del grads  # reaching the roots ran every layer's hook; their gradients themselves are not needed


def per_reward_gradients(jacobian: torch.Tensor, r: torch.Tensor, nft_beta: float,
                         adv_clip_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [K, P] = W J, W [K, 2b]): every masked per-reward gradient of one unit from its J [2b, P] (float64), and
    the mixing that made them (for :func:`conflict_attribution`)."""
    mixing = reward_mixing(r.double(), nft_beta, adv_clip_max).to(jacobian.device)
    return mixing @ jacobian.double(), mixing


@dataclass
class Attribution:
    """Which samples drive a unit's worst conflict: the pair of rewards (k, l) with the lowest gradient cosine,
    that cosine, and each sample's share of it (``shares`` [b], summing to ``cosine``)."""

    k: int
    l: int
    cosine: float
    shares: torch.Tensor


def conflict_attribution(jacobian: torch.Tensor, mixing: torch.Tensor, g: torch.Tensor) -> Attribution | None:
    """Each sample's share of the unit's worst cosine, exactly, from its per-sample gradients.

    Sample i's part of g_k is s_{k,i} = W[k,i]·p_i + W[k,b+i]·q_i, so g_k·g_l = Σ_i ½(s_{k,i}·g_l + s_{l,i}·g_k):
    the share c_i = ½(s_{k,i}·g_l + s_{l,i}·g_k) / (|g_k|·|g_l|) sums to cos(g_k, g_l) over the samples. A large
    negative c_i is a sample whose gradient for one reward points against the other reward's. Costs one product
    J·[g_k, g_l]ᵀ ([2b, 2]). None when fewer than two rewards have a gradient. Shapes: jacobian [2b, P],
    mixing [K, 2b], g [K, P]."""
    norms = g.norm(dim=1)
    valid = torch.isfinite(norms) & (norms > 1e-12)
    idx = valid.nonzero().flatten().tolist()
    if len(idx) < 2:
        return None
    cos = (g @ g.T) / torch.outer(norms, norms).clamp(min=1e-300)
    k, l = min(((a, b) for i, a in enumerate(idx) for b in idx[i + 1:]), key=lambda kl: float(cos[kl]))
    d = jacobian.double() @ g[[k, l]].T  # [2b, 2]: every p_i, q_i against g_k and g_l
    b = jacobian.shape[0] // 2
    w = mixing.to(d.dtype)
    towards_l = w[k, :b] * d[:b, 1] + w[k, b:] * d[b:, 1]  # s_{k,i}·g_l
    towards_k = w[l, :b] * d[:b, 0] + w[l, b:] * d[b:, 0]  # s_{l,i}·g_k
    shares = 0.5 * (towards_l + towards_k) / (norms[k] * norms[l])
    return Attribution(k, l, float(cos[k, l]), shares.cpu())
