"""Checkpoint benchmark (make bench): what a trusted checkpoint costs (docs/reliability.md).

Per preset: the folder's size, and the median seconds to write it (LoRA + safetensors state + JSON +
manifest with fsync, then the atomic rename), to verify its manifest, and to verify and load it into a
trainer (what a resume adds). No target: the figures are to be read against the preset's step time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

PRESETS = ("tiny", "mini-marble")


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench_checkpoint(presets: tuple[str, ...] = PRESETS, repeats: int = 3) -> dict:
    from core import checkpoint as ckpt_io
    from core.config import preset
    from core.trainer import Trainer

    out = {"bench": "checkpoint", "repeats": repeats, "presets": {}}
    for name in presets:
        cfg = preset(name).with_overrides({"steps": 1, "checkpoint_every": 0, "sample_every": 0})
        trainer = Trainer(cfg, tempfile.mkdtemp(prefix=f"bench_ckpt_{name}_"))
        trainer.train_step(0)  # optimizer moments exist, as in any real checkpoint
        write, check, load = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            folder = trainer.save_checkpoint()
            write.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt_io.verify(folder)
            check.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            trainer.load_checkpoint(folder)
            load.append(time.perf_counter() - t0)
        out["presets"][name] = {
            "bytes": _folder_bytes(folder), "files": len([p for p in folder.rglob("*") if p.is_file()]),
            "write_s": round(statistics.median(write), 4), "verify_s": round(statistics.median(check), 4),
            "verify_and_load_s": round(statistics.median(load), 4)}
    return out

