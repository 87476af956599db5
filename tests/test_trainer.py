"""Real training steps on the tiny SD3: the engine's behaviour end to end (CPU, no network)."""

import json
import math

import numpy as np
import pytest
import torch

from core.advantages import per_reward_advantages
from core.loss import advantage_to_r, nft_loss, per_reward_objectives
from core.models import VelocityInputs
from core.trainer import Trainer, train
from tests.helpers import small_config

pytestmark = pytest.mark.slow


def _lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.named_trainable.items()}


def _collect():
    events = []
    return events, events.append


def test_three_marble_steps_train_and_emit_step_and_balance_events(tmp_path):
    events, on_event = _collect()
    trainer = Trainer(small_config("marble", steps=3, **{"balance.harmonize_every": 2, "nft.kl_coef": 0.0}),
                      tmp_path, on_event)
    before = _lora(trainer)
    result = trainer.run()
    assert result.status == "completed" and result.step == 3
    after = _lora(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for ev in events:  # every event serializes to strict JSON
        json.loads(json.dumps(ev.to_dict(), allow_nan=False))
    steps = [e for e in events if e.kind == "step"]
    balances = [e for e in events if e.kind == "balance"]
    assert [e.step for e in steps] == [1, 2, 3]
    assert [e.phase for e in steps] == ["harmonized", "amortized", "harmonized"]  # warm-up, then every N=2
    assert [b.step for b in balances] == [1, 3] and all(b.phase == "harmonized" for b in balances)
    names = trainer.reward_names
    for b in balances:
        alpha = np.array([b.alpha_raw[n] for n in names])
        assert np.all(alpha >= -1e-9) and alpha.sum() == pytest.approx(1.0, abs=1e-6)
        cos = np.array(b.cosine["matrix"])
        assert cos.shape == (3, 3) and np.allclose(cos, cos.T) and np.allclose(np.diag(cos), 1.0)
        # MGDA: the harmonized direction conflicts with no reward's gradient (KL off here)
        assert all(b.cos_to_update[n] >= -1e-6 for n in names if b.valid[n])
        assert b.solver.startswith(("cvxpy", "single-valid"))
    # amortized steps use the EMA of the solves: ᾱ after step 3 = 0.7·ᾱ₁ + 0.3·α*₃ (ᾱ₁: after the warm-up
    # step's per-unit solves)
    ema1 = np.array([balances[0].alpha_ema[n] for n in names])
    a3 = np.array([balances[1].alpha_raw[n] for n in names])
    assert np.allclose([balances[1].alpha_ema[n] for n in names], 0.7 * ema1 + 0.3 * a3, atol=1e-9)
    assert np.allclose([steps[1].alpha[n] for n in names], ema1, atol=1e-9)
    assert (tmp_path / "checkpoints" / "step_000003" / "pytorch_lora_weights.safetensors").is_file()


def test_resume_after_step_two_reproduces_an_uninterrupted_four_step_run(tmp_path):
    cfg = small_config("marble", steps=4, **{"balance.harmonize_every": 3, "checkpoint_every": 2})
    full_events, on_full = _collect()
    straight = Trainer(cfg, tmp_path / "straight", on_full)
    straight.run()

    half = Trainer(cfg.with_overrides({"steps": 2}), tmp_path / "resumed")
    half.run()
    resumed_events, on_resumed = _collect()
    resumed = Trainer(cfg, tmp_path / "resumed", on_resumed)
    resumed.run(resume_from=tmp_path / "resumed" / "checkpoints" / "step_000002")

    a, b = _lora(straight), _lora(resumed)
    assert all(torch.allclose(a[n], b[n], atol=1e-7, rtol=0) for n in a)
    assert all(torch.allclose(straight.policy.old[n], resumed.policy.old[n], atol=1e-7, rtol=0) for n in a)
    sa, sb = straight.balancer.state_dict(), resumed.balancer.state_dict()
    assert np.allclose(sa["alpha_ema"], sb["alpha_ema"]) and sa["last_harmonized_step"] == sb["last_harmonized_step"]
    later = lambda evs: [e for e in evs if e.kind == "step" and e.step > 2]
    for x, y in zip(later(full_events), later(resumed_events), strict=True):
        assert x.step == y.step and x.rewards == pytest.approx(y.rewards, abs=1e-6)
    assert [e.phase for e in resumed_events if e.kind == "step"] == ["amortized", "harmonized"]


def test_resume_refuses_a_changed_config(tmp_path):
    cfg = small_config("marble", steps=1)
    train(cfg, tmp_path)
    changed = cfg.with_overrides({"balance.ema_rho": 0.3, "steps": 2})
    with pytest.raises(ValueError, match="differs from the checkpoint's in balance"):
        train(changed, tmp_path, resume_from=tmp_path / "checkpoints" / "step_000001")


def test_amortized_gradient_equals_the_alpha_weighted_sum_of_per_reward_gradients(tmp_path):
    """Proposition 1 on the real transformer: one backward on r(Σ α_k A_k) = Σ α_k ∇ℓ_k(A_k)."""
    trainer = Trainer(small_config("marble", **{"nft.kl_coef": 0.0}), tmp_path)
    with torch.no_grad():  # move θ away from θ_old so the loss has a non-trivial gradient
        for p in trainer.params:
            p.add_(0.02 * torch.randn_like(p))
    batch = trainer.rollout(0)
    R = trainer.score(batch)
    A = per_reward_advantages(R, batch.groups)
    assert torch.isfinite(A).all() and A.abs().max() < 5.0  # inside the clip: the proposition's condition
    idx = torch.arange(len(batch.prompts))
    t = torch.full((len(idx),), 0.7)
    noise = torch.randn(batch.x0.shape, generator=torch.Generator().manual_seed(0))
    l_pos, l_neg, _ = trainer._forward(batch, idx, t, noise)
    per_reward = per_reward_objectives(l_pos, l_neg, advantage_to_r(A, 5.0), 0.1, 5.0)
    g = torch.stack([trainer._grads(per_reward[k]) for k in range(3)])
    alpha = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    # the authors' single loss on the combined advantage Ā = Σ α_k A_k
    x0 = batch.x0
    x_t = (1 - 0.7) * x0 + 0.7 * noise
    inp = VelocityInputs(x_t, t, batch.embeddings.prompt_embeds, batch.embeddings.pooled)
    r_bar = advantage_to_r(A.double() @ alpha, 5.0).float()
    amortized = nft_loss(trainer.policy.velocity(inp), trainer.policy.velocity_old(inp), x_t, x0, t, r_bar).mean()
    g_amortized = trainer._grads(amortized, retain=False)
    expected = alpha @ g
    assert g_amortized.norm() > 1e-6
    rel = float((g_amortized - expected).norm() / expected.norm())
    assert rel < 1e-4, rel  # float32 forward: agreement to rounding
    # and the match is not an accident of near-equal gradients: the rewards' gradients differ a lot
    assert float((g[0] - g[1]).norm() / expected.norm()) > 1e-2


@pytest.mark.parametrize("strategy", ["weighted_sum", "equal", "single", "sequential", "marble_full"])
def test_every_strategy_trains_and_can_be_diagnosed(tmp_path, strategy):
    events, on_event = _collect()
    trainer = Trainer(small_config(strategy, steps=2, **{"balance.diagnose_every": 1}), tmp_path, on_event)
    before = _lora(trainer)
    trainer.run()
    after = _lora(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    steps = [e for e in events if e.kind == "step"]
    balances = [e for e in events if e.kind == "balance"]
    assert len(steps) == 2 and len(balances) == 2  # diagnostics every step (M=1)
    expected_phase = "harmonized" if strategy == "marble_full" else "diagnostic"
    assert all(b.phase == expected_phase for b in balances)
    for b in balances:
        assert set(b.cos_to_update) == set(trainer.reward_names)
        assert any(math.isfinite(v) for v in b.cos_to_update.values())
    if strategy == "single":
        assert all(s.alpha == {"jpeg_compressibility": 0.0, "colorfulness": 1.0, "brightness": 0.0} for s in steps)
    if strategy == "sequential":
        assert [s.stage for s in steps] == [0, 1]
        assert steps[1].alpha["colorfulness"] == 0.0 and steps[1].alpha["brightness"] == pytest.approx(0.5)


def test_harmonize_scope_step_solves_once_on_the_whole_step(tmp_path):
    events, on_event = _collect()
    train(small_config("marble", steps=1, **{"balance.harmonize_scope": "step", "nft.kl_coef": 0.0}),
          tmp_path, on_event)
    (b,) = [e for e in events if e.kind == "balance"]
    assert b.phase == "harmonized" and all(v >= -1e-6 for v in b.cos_to_update.values() if v is not None)


def test_stop_flag_ends_the_run_with_a_checkpoint(tmp_path):
    events, on_event = _collect()
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return any(e.kind == "step" and e.step >= 1 for e in events)

    result = train(small_config("marble", steps=5), tmp_path, on_event, should_stop)
    assert result.status == "stopped" and result.step == 1
    assert result.last_checkpoint and (result.last_checkpoint / "training_state.safetensors").is_file()
    assert events[-1].kind == "end" and events[-1].status == "stopped"


def test_a_failing_observer_does_not_stop_training(tmp_path):
    seen = []

    def broken(event):
        seen.append(event.kind)
        raise RuntimeError("observer bug")

    result = train(small_config("marble", steps=2), tmp_path, broken)
    assert result.status == "completed" and result.step == 2
    assert seen.count("step") == 2


def test_samples_are_saved_with_per_image_scores(tmp_path):
    events, on_event = _collect()
    train(small_config("equal", steps=1, sample_every=1), tmp_path, on_event)
    (s,) = [e for e in events if e.kind == "samples"]
    assert len(s.items) == 8
    item = s.items[0]
    assert (tmp_path / item["path"]).is_file()
    assert set(item["rewards"]) == {"jpeg_compressibility", "colorfulness", "brightness"}
    assert set(item["advantages"]) == set(item["rewards"])


def test_previews_render_the_same_prompts_and_seeds_at_every_sample_step(tmp_path):
    events, on_event = _collect()
    train(small_config("marble", steps=2, sample_every=1, preview_prompts=3), tmp_path, on_event)
    previews = [e for e in events if e.kind == "previews"]
    assert [e.step for e in previews] == [1, 2]  # beside each step's rollout samples
    first, second = ([(i["prompt"], i["seed"]) for i in e.items] for e in previews)
    assert first == second and [seed for _, seed in first] == [0, 1, 2]
    import numpy as np
    from PIL import Image

    pixels = [[np.asarray(Image.open(tmp_path / i["path"])) for i in e.items] for e in previews]
    assert all(a.shape == pixels[0][0].shape for row in pixels for a in row)
    assert any(not np.array_equal(a, b) for a, b in zip(*pixels))  # training changed the rendered images
    assert set(previews[0].items[0]["rewards"]) == {"jpeg_compressibility", "colorfulness", "brightness"}
    # the same prompts and seeds in another run: a run's seed does not pick them
    other = Trainer(small_config("marble", steps=1, preview_prompts=3, seed=9), tmp_path / "other")
    items, seeds = other.preview_items()
    assert list(zip([it.text for it in items], seeds)) == first


def test_a_harmonized_step_says_which_samples_drive_its_worst_conflict(tmp_path):
    events, on_event = _collect()
    cfg = small_config("marble", steps=1, sample_every=1, preview_prompts=0, **{"balance.gradients": "per_sample"})
    train(cfg, tmp_path, on_event)
    (bal,) = [e for e in events if e.kind == "balance"]
    att = bal.attribution
    names, matrix = bal.cosine["names"], bal.cosine["matrix"]
    k, l = (names.index(n) for n in att["pair"])
    # the harmonized unit is the one solved on: its worst pair and cosine are the recorded matrix's
    off = [(matrix[a][b], (a, b)) for a in range(len(names)) for b in range(a + 1, len(names))]
    assert min(off)[1] == (min(k, l), max(k, l)) and att["cosine"] == pytest.approx(matrix[k][l], abs=1e-9)
    assert len(att["samples"]) == cfg.nft.micro_batch_size
    assert sum(s["share"] for s in att["samples"]) == pytest.approx(att["cosine"], abs=1e-9)
    rollout_prompts = {i["prompt"] for e in events if e.kind == "samples" for i in e.items}
    assert all(s["prompt"] in rollout_prompts and 0 < s["sigma"] <= 1 for s in att["samples"])
    assert att["scope"] == "solve"
    # a step solved whole: its last unit's own conflict, said to be so
    events, on_event = _collect()
    train(small_config("marble_full", steps=1, **{"balance.gradients": "per_sample", "balance.harmonize_scope": "step"}),
          tmp_path / "whole", on_event)
    (bal,) = [e for e in events if e.kind == "balance"]
    assert bal.attribution["scope"] == "unit" and len(bal.attribution["samples"]) == cfg.nft.micro_batch_size
    assert sum(s["share"] for s in bal.attribution["samples"]) == pytest.approx(bal.attribution["cosine"], abs=1e-9)
    # the K-backward path has no per-sample gradients: no attribution, said by an empty record
    events, on_event = _collect()
    train(small_config("marble", steps=1, **{"balance.gradients": "per_reward"}), tmp_path / "k", on_event)
    assert [e.attribution for e in events if e.kind == "balance"] == [{}]


def test_no_previews_when_preview_prompts_is_zero(tmp_path):
    events, on_event = _collect()
    train(small_config("equal", steps=1, sample_every=1, preview_prompts=0), tmp_path, on_event)
    assert [e.kind for e in events].count("samples") == 1 and "previews" not in [e.kind for e in events]
    assert not (tmp_path / "previews").exists()


def test_a_warm_up_step_harmonizes_every_unit_each_solve_updating_the_ema(tmp_path):
    # B = 8 in micro-batches of 4, 3 training timesteps per sample (int(0.99 · 4)): 6 units per step
    events, on_event = _collect()
    trainer = Trainer(small_config("marble", steps=2, **{"balance.warmup_steps": 1, "balance.harmonize_every": 10}),
                      tmp_path, on_event)
    solves = []
    balance = trainer.balancer.balance
    trainer.balancer.balance = lambda gram, step: solves.append(step) or balance(gram, step)
    trainer.run()
    assert solves == [0] * 6  # step 0: one solve per unit; step 1: amortized
    assert trainer.balancer.num_solves == 6
    (b,) = [e for e in events if e.kind == "balance"]
    assert b.solve_seconds > 0  # the real solve time, not a default 0


def test_after_the_warm_up_a_full_step_harmonizes_its_first_unit_only(tmp_path):
    trainer = Trainer(small_config("marble", steps=3, **{"balance.warmup_steps": 1, "balance.harmonize_every": 2}),
                      tmp_path)
    solves = []
    balance = trainer.balancer.balance
    trainer.balancer.balance = lambda gram, step: solves.append(step) or balance(gram, step)
    trainer.run()
    assert solves == [0] * 6 + [2]


@pytest.mark.parametrize("combination", ["masked", "authors"])
def test_amortized_units_train_with_either_combination(tmp_path, combination):
    # Specialist-like NaNs come from the mini world; here the weight-free rewards all apply, so the two forms
    # agree up to clipping — the test checks the option reaches the loss (tests/test_loss.py checks the formulas).
    trainer = Trainer(small_config("marble", steps=2, **{"balance.amortized_combination": combination}), tmp_path)
    seen = []
    import core.trainer as trainer_module
    original = trainer_module.amortized_objective
    trainer_module.amortized_objective = lambda *a, **k: seen.append(a[4]) or original(*a, **k)
    try:
        trainer.run()
    finally:
        trainer_module.amortized_objective = original
    assert seen and set(seen) == {combination}


def test_the_parameter_ema_follows_the_releases_schedule_and_is_what_evaluation_loads_by_default(tmp_path):
    from peft.utils import get_peft_model_state_dict

    from core.models import load_lora, load_pipeline

    trainer = Trainer(small_config("equal", steps=2, **{"optim.ema_decay": 0.9}), tmp_path)
    theta = [_lora(trainer)]
    trainer.on_event = lambda e: theta.append(_lora(trainer)) if e.kind == "step" else None
    trainer.run()
    expected = dict(theta[0])
    for k in (1, 2):  # θ_ema ← d·θ_ema + (1 − d)·θ_k, d = min((1 + k)/(10 + k), 0.9)
        d = min((1 + k) / (10 + k), 0.9)
        expected = {n: d * expected[n] + (1 - d) * theta[k][n] for n in expected}
    assert all(torch.allclose(trainer.ema[n], expected[n], atol=1e-7) for n in expected)
    assert any(not torch.allclose(trainer.ema[n], theta[2][n]) for n in expected)  # EMA ≠ raw

    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert (ckpt / "ema" / "pytorch_lora_weights.safetensors").is_file()
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file()

    def norms(tensors):  # the adapter's tensors, named differently by peft and by us: compare their norms
        return torch.tensor(sorted(float(t.double().norm()) for t in tensors))

    def loaded(weights):
        pipe = load_pipeline("tiny")
        which = load_lora(pipe, ckpt, *([weights] if weights else []))
        adapter = next(iter(pipe.transformer.peft_config))
        return which, norms(get_peft_model_state_dict(pipe.transformer, adapter_name=adapter).values())

    which, got = loaded(None)
    assert which == "ema" and torch.allclose(got, norms(trainer.ema.values()), rtol=1e-5)
    which, got = loaded("raw")
    assert which == "raw" and torch.allclose(got, norms(theta[2].values()), rtol=1e-5)
    assert not torch.allclose(norms(trainer.ema.values()), norms(theta[2].values()), rtol=1e-5)

    # a resumed run carries the EMA on
    resumed = Trainer(small_config("equal", steps=2, **{"optim.ema_decay": 0.9}), tmp_path / "again")
    resumed.load_checkpoint(ckpt)
    assert all(torch.equal(resumed.ema[n], trainer.ema[n]) for n in expected)


def test_diagnostics_record_the_cosine_with_the_papers_weighted_sum_direction(tmp_path):
    # equal α = 1/K, masked combination, no KL: the applied update IS (1/K)·Σ g_k, so both cosines agree
    events, on_event = _collect()
    train(small_config("equal", steps=1, **{"balance.diagnose_every": 1, "nft.kl_coef": 0.0}), tmp_path, on_event)
    (b,) = [e for e in events if e.kind == "balance"]
    assert set(b.cos_to_mean) == set(b.cos_to_update)
    for n in b.cos_to_update:
        assert b.cos_to_mean[n] == pytest.approx(b.cos_to_update[n], abs=1e-5)
    # and a MARBLE full step's update is not that direction: the two are recorded apart
    events, on_event = _collect()
    train(small_config("marble", steps=1, **{"nft.kl_coef": 0.0}), tmp_path / "m", on_event)
    (b,) = [e for e in events if e.kind == "balance"]
    assert any(abs(b.cos_to_mean[n] - b.cos_to_update[n]) > 1e-4 for n in b.cos_to_update)


def test_a_sequential_stage_samples_only_its_own_sources(tmp_path):
    cfg = small_config("sequential", steps=2, **{
        "prompts.sources": ["world-color", "world-count", "world-general"],
        "sampling.prompts_per_step": 3,
        "balance.stages": [{"rewards": ["colorfulness"], "steps": 1, "sources": ["world-color"]},
                           {"rewards": ["brightness"], "steps": 1, "sources": ["world-count", "world-general"]}]})
    trainer = Trainer(cfg, tmp_path)
    first, second = ({m["source"] for m in trainer.rollout(s).metadata} for s in (0, 1))
    assert first == {"world-color"}
    assert second <= {"world-count", "world-general"} and len(second) == 2
    # without stage sources, every source of the run is drawn
    plain = Trainer(cfg.with_overrides({"balance.stages": [{"rewards": ["colorfulness"], "steps": 2}]}), tmp_path)
    assert {m["source"] for m in plain.rollout(0).metadata} == {"world-color", "world-count", "world-general"}


def test_stage_sources_must_be_sources_of_the_run():
    from core.config import ConfigError

    with pytest.raises(ConfigError, match=r"balance.stages\[0\].sources=\['world-color'\]: must be distinct sources "
                                          r"of the run \(prompts.sources: tiny\)"):
        small_config("sequential", **{"balance.stages": [{"rewards": ["colorfulness"], "steps": 1,
                                                          "sources": ["world-color"]}]})


def test_the_harmonized_micro_batch_holds_every_reward_that_has_a_valid_sample():
    from core.trainer import harmonized_order

    # 8 samples, micro-batches of 3; reward 0 general, reward 1 valid only on samples 5 and 6, reward 2 only on 2
    valid = torch.zeros(8, 3, dtype=torch.bool)
    valid[:, 0] = True
    valid[[5, 6], 1] = True
    valid[2, 2] = True
    order, missing = harmonized_order(valid, 3)
    assert sorted(order.tolist()) == list(range(8)) and missing == []
    head = valid[order[:3]]
    assert head.any(dim=0).all()  # every reward present in the first micro-batch
    assert 2 in order[:3].tolist()  # reward 2's only sample stayed
    # nothing moves when every reward is already present
    valid[1, 1] = True
    assert torch.equal(harmonized_order(valid, 3)[0], torch.arange(8))
    # a reward valid nowhere is not asked for; one that cannot fit is reported
    none = torch.zeros(4, 3, dtype=torch.bool)
    none[0, 0], none[3, 1], none[2, 2] = True, True, True
    order, missing = harmonized_order(none, 1)  # one slot for three rewards
    assert order[0].item() == 0 and missing == [1, 2]


def test_reward_dropout_masks_a_dropped_reward_on_the_samples_other_rewards_cover(tmp_path):
    cfg = small_config("marble", steps=1, **{"balance.reward_dropout": {"colorfulness": 1.0}})
    trainer = Trainer(cfg, tmp_path)
    r = torch.rand(6, 3)
    r[:3, 0] = r[:3, 2] = math.nan  # the unlisted rewards (jpeg, brightness) apply to samples 3..5 only
    A = torch.randn(6, 3)
    r2, A2, dropped = trainer._reward_dropout(0, 0, r, A)
    assert dropped == ["colorfulness"]
    k = trainer.reward_names.index("colorfulness")
    assert torch.isnan(r2[3:, k]).all() and torch.equal(r2[:3, k], r[:3, k])  # kept where no other reward applies
    assert torch.isnan(A2[3:, k]).all() and torch.equal(A2[:3, k], A[:3, k])
    assert torch.equal(r2[3:, 2], r[3:, 2]) and torch.isnan(r2[:3, 2]).all()  # brightness: not listed, untouched
    # probability 0, or a step inside a warm-up ramp that starts at 0, drops nothing
    none = Trainer(cfg.with_overrides({"balance.reward_dropout_warmup_steps": 10}), tmp_path)
    assert none._reward_dropout(0, 0, r, A)[2] == []
    events, on_event = _collect()
    train(cfg, tmp_path / "run", on_event)  # and it trains, recording what was dropped on the solve
    (b,) = [e for e in events if e.kind == "balance"]
    assert b.dropped == ["colorfulness"]


def test_a_checkpoint_from_before_the_new_fields_and_the_parameter_ema_resumes(tmp_path):
    from core import checkpoint as ckpt_io

    cfg = small_config("equal", steps=1)
    train(cfg, tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    tensors, meta = ckpt_io.load_state(ckpt)  # rewrite it as an older version wrote it
    del meta["config"]["optim"]["ema_decay"], meta["config"]["sampling"]["sampler"]
    tensors = {k: v for k, v in tensors.items() if not k.startswith("ema/")}
    import shutil
    shutil.rmtree(ckpt / "ema")
    (ckpt / ckpt_io.MANIFEST_FILE).unlink()
    ckpt_io.save_state(ckpt, tensors, meta)
    ckpt_io.write_manifest(ckpt)
    events, on_event = _collect()
    resumed = Trainer(cfg.with_overrides({"steps": 2}), tmp_path, on_event)
    resumed.load_checkpoint(ckpt)
    assert resumed.step == 1
    assert all(torch.equal(resumed.ema[n], p) for n, p in resumed.policy.named_trainable.items())
    assert any(e.kind == "notice" and "holds no parameter EMA" in e.message for e in events)


def test_a_diverging_step_stops_the_run_and_names_the_learning_rate(tmp_path, monkeypatch):
    """lr 1e9 turned the LoRA weights to NaN, and the run failed one step later on a reward's 'images contain NaN'
    with no word of optim.lr (new-user pass). The config now caps lr, and a step that leaves non-finite weights
    stops the run there, naming the learning rate and the clip."""
    from core.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.lr=1000000000.0: must be a number in \(0, 1\]"):
        small_config("marble", **{"optim.lr": 1e9})
    trainer = Trainer(small_config("marble", steps=2), tmp_path)
    step = trainer.optimizer.step

    def poisoned():  # what an overflowing update does to the weights
        step()
        with torch.no_grad():
            trainer.params[0].fill_(float("nan"))

    monkeypatch.setattr(trainer.optimizer, "step", poisoned)
    with pytest.raises(FloatingPointError, match=r"training diverged at step 1: .*optim.lr=0\.\d+.*lower optim.lr"):
        trainer.run()
