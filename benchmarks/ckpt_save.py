"""What a checkpoint costs: the trainer's save and its resume check, timed for a preset in one process.

    python benchmarks/ckpt_save.py --config hymo_750m [--out ckpt_save.json]   # a GPU: about 2 minutes
    python benchmarks/ckpt_save.py                                             # hymo_tiny on a CPU: seconds

Builds the preset's `Trainer` on the bundled corpus (no compile, one micro-batch a step), trains one
step so that every optimiser moment exists, then times `Trainer.save` --repeat times and
`Trainer.load` of the last checkpoint once. The CRC-32 of the files (chapter 70: the save reads
back what it wrote, the resume checks it before reading) is timed inside each, by wrapping the
trainer's `file_crc`. Both read from the page cache here, as a save does; a resume after a reboot
reads the disk, at its speed. Prints a table and writes one JSON row.
"""
import argparse
import tempfile
import time
from pathlib import Path

import torch

import hymo.training.trainer as trainer_module
from hymo.config import ConfigError, load_config
from hymo.training.trainer import Trainer
from need_gpu import add_row, check_out, provenance  # the script beside this one


class CrcTimer:
    "Inside `with`, the trainer's `file_crc` goes through this: seconds spent in it and bytes read, since the last `reset`."
    def __enter__(self):
        self.real, self.seconds, self.bytes = trainer_module.file_crc, 0.0, 0
        trainer_module.file_crc = self
        return self

    def __exit__(self, *exc): trainer_module.file_crc = self.real

    def __call__(self, path):
        t0 = time.perf_counter()
        out = self.real(path)
        self.seconds, self.bytes = self.seconds + time.perf_counter() - t0, self.bytes + out["size"]
        return out

    def reset(self): self.seconds, self.bytes = 0.0, 0


def timed(fn) -> float:
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="hymo_tiny", help="preset (default hymo_tiny)")
    ap.add_argument("--repeat", type=int, default=2, help="saves to time (default 2)")
    ap.add_argument("--run-dir", help="a folder on the disk to time (default the system's temporary folder; where /tmp is in "
                                      "memory that times memory); the run is written in a new folder inside it, removed after")
    ap.add_argument("--out", help="add the row to this JSON list, first (the results page reads newest first)")
    args = ap.parse_args(argv)
    if args.repeat < 1: ap.error("--repeat must be at least 1")
    if args.run_dir and not Path(args.run_dir).is_dir(): ap.error(f"--run-dir {args.run_dir} is not a folder; give one on the disk to time")
    check_out(ap, args.out, adds=list)
    try: base = load_config(args.config)
    except ConfigError as e: ap.error(str(e))
    cfg = load_config(args.config, compile=False, max_steps=2, warmup_steps=0, eval_every=0, ckpt_every=1000,
                      global_batch_size=base.train.micro_batch_size, sample_tokens=0, wandb=False)
    with tempfile.TemporaryDirectory(dir=args.run_dir, prefix="ckpt_save-") as tmp, CrcTimer() as crc:
        run_dir = Path(tmp) / "run"
        tr = Trainer(cfg.model, cfg.train, run_dir=run_dir, resume=False, name=args.config, quiet=True)
        tr.fit(num_steps=1)
        saves = []
        for _ in range(args.repeat):
            crc.reset()
            seconds = timed(lambda: saves.append(tr.save()))
            saves[-1] = (saves[-1], seconds, crc.seconds)
        ckpt, save_s, save_crc_s = saves[-1]
        files = [p for p in ckpt.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        crc.reset()
        load_s = timed(lambda: tr.load(ckpt))
        load_crc_s, checked = crc.seconds, crc.bytes
        meta_bytes = (ckpt / "meta.json").stat().st_size

    row = {"config": args.config, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           **provenance(), "files": len(files), "checkpoint_bytes": size, "meta_json_bytes": meta_bytes,
           "save_s": [round(s, 3) for _, s, _ in saves], "save_crc_s": [round(c, 3) for _, _, c in saves],
           "load_s": round(load_s, 3), "load_crc_s": round(load_crc_s, 3), "load_checked_bytes": checked}
    print(f"{args.config} on {row['device']}: checkpoint of {len(files)} files, {size / 1e9:.2f} GB")
    for i, (_, s, c) in enumerate(saves):
        print(f"  save {i + 1}: {s:7.2f} s, of which CRC-32 {c:6.2f} s ({size / max(c, 1e-9) / 1e9:.1f} GB/s)")
    print(f"  load  : {load_s:7.2f} s, of which the check {load_crc_s:6.2f} s ({checked / 1e9:.2f} GB read)")
    if args.out: add_row(args.out, row)
    return row


if __name__ == "__main__":
    main()
