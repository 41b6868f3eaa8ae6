"""ffcv_ddpm.numba_cache: FFCV's import compiles numba's typed-dict helpers once per machine, not once per process."""

import json
import os
import subprocess
import sys

from conftest import REPO

_PROBE = """
import json, sys
from ffcv_ddpm.numba_cache import cache_typed_dict
cache_typed_dict()
import ffcv  # builds ffcv.fields.rgb_image.IMAGE_MODES, a numba.typed.Dict
from ffcv.fields.rgb_image import IMAGE_MODES
from numba.typed.typeddict import _setitem
stats = _setitem.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values()),
                  "modes": dict(IMAGE_MODES)}))
"""


def probe(cache_dir) -> dict:
    # A cache folder of the test's own: numba writes beside its sources when it can, which another run may have
    # filled already; NUMBA_CACHE_DIR sends every cache file here, empty at the first process.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_second_process_loads_the_typed_dict_from_the_cache(tmp_path):
    first, second = probe(tmp_path), probe(tmp_path)
    assert first["misses"] >= 1 and first["hits"] == 0  # compiled, and written to the cache
    assert second["hits"] >= 1 and second["misses"] == 0  # loaded: nothing compiled
    assert first["modes"] == second["modes"] == {"jpg": 0, "raw": 1}  # the dict FFCV built works as compiled
    assert any(tmp_path.rglob("*.nbi")) and any(tmp_path.rglob("*.nbc"))
