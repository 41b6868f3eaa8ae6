"""TensorBoard events beside stats.jsonl (train.tensorboard=True): every stats line's numbers and the sample grids.

    board = TensorBoardLog(run_dir, resumed_at=0)   # run_dir/tensorboard/; view with `tensorboard --logdir runs`
    board.stats(stats)                              # one stats.jsonl line: loss, img/s, data wait, lr, eval metrics
    board.image("samples", run_dir / "samples-00010000.png", 10_000)
    board.close()

It writes what the loop has already read at a log interval (host numbers; a tensor is refused), so it adds no
host-device sync. On --resume, the events after the checkpoint's step are hidden (SummaryWriter's purge_step), as
stats.jsonl drops its lines after that step: one history either way.
"""

from __future__ import annotations

import importlib.util
import numbers
from pathlib import Path

# Tag of each stats.jsonl field: TensorBoard groups the charts by the part before "/". A field not listed here (a new
# stats field, or an evaluation's fid / fd_digits / cond_acc) goes under eval/. A list (one value per DDP rank) is
# one chart per element: <tag>/<rank>.
TAGS = {
    "loss": "train/loss", "lr": "train/lr",
    "img_per_s": "speed/img_per_s", "img_per_s_wall": "speed/img_per_s_wall", "iter_ms_median": "speed/iter_ms_median",
    "data_wait_ms": "data/wait_ms", "data_wait_share": "data/wait_share",
    "rank_data_wait_share": "data/wait_share_of_rank", "rank_iter_ms_mean": "speed/iter_ms_mean_of_rank",
    "peak_mem_gib": "memory/peak_gib",
}
NOT_LOGGED = ("step", "wall_s")  # the x axis, and TensorBoard's own wall time
INSTALL = "pip install tensorboard==2.21.0 (requirements.txt)"


def missing_package() -> str | None:
    """Why train.tensorboard=True cannot run here (one line), or None. Checked before the run folder is made."""
    if importlib.util.find_spec("tensorboard") is None:
        return f"train.tensorboard=True needs the tensorboard package, which is not installed: {INSTALL}"
    return None


class TensorBoardLog:
    """Events in `run_dir`/tensorboard. `resumed_at`: the checkpoint step a resumed run starts from (0: a new run)."""

    def __init__(self, run_dir: Path, resumed_at: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
        # purge_step: events of earlier sessions at steps >= it are hidden, so steps logged after the checkpoint by
        # the run that was stopped show once, from this run.
        self._writer = SummaryWriter(str(self.dir), purge_step=resumed_at + 1 if resumed_at else None)

    def stats(self, stats: dict) -> None:
        scalars = {}
        for key, value in stats.items():
            if key in NOT_LOGGED or value is None:
                continue
            tag = TAGS.get(key, f"eval/{key}")
            for name, v in ({f"{tag}/{i}": v for i, v in enumerate(value)} if isinstance(value, (list, tuple))
                            else {tag: value}).items():
                if not isinstance(v, numbers.Real):  # a tensor would be read here: a sync the loop must not gain
                    raise TypeError(f"stats[{key!r}] holds {type(v).__name__}: log host numbers read at the interval")
                scalars[name] = float(v)
        for name, v in scalars.items():  # all or nothing
            self._writer.add_scalar(name, v, stats["step"])
        self._writer.flush()  # stats.jsonl and the events agree whenever the run stops

    def image(self, tag: str, png: Path, step: int) -> None:
        """A sample grid as saved (the PNG is lossless: TensorBoard shows the pixels of the file)."""
        import numpy as np
        from PIL import Image

        with Image.open(png) as im:
            pixels = np.asarray(im.convert("RGB"))  # (H, W, 3) uint8; a 1-channel grid shows as grey
        self._writer.add_image(tag, pixels, step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
