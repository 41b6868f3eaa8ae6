"""FFCV's import ~2.5 s faster in every process after the first: numba's on-disk cache for its typed dict.

`import ffcv` builds a numba.typed.Dict at module level (ffcv.fields.rgb_image's IMAGE_MODES), and numba compiles
the dict's helpers (numba.typed.typeddict: _setitem, ...) for it in every process: 2.5 of the 3.8 s that importing
FFCV took on a 2-core machine, paid by every trainer, benchmark row and test process. Those helpers are plain
@njit functions without numba's `cache=True`; enable_caching() is what that flag does, so their machine code is kept
on disk (beside numba's sources, else in numba's user cache: NUMBA_CACHE_DIR) and invalidated with numba's files,
as numba's own cached functions are. FFCV's pipeline code is generated per loader and stays uncached.

Call cache_typed_dict() before the first `import ffcv` (ffcv_ddpm.data, ffcv_ddpm.ffcv_loader, tools.ffcv_writer do).
"""

_done = False


def cache_typed_dict() -> None:
    global _done
    if _done:
        return
    import numba.typed.typeddict as typeddict
    from numba.core.dispatcher import Dispatcher

    for f in vars(typeddict).values():
        if isinstance(f, Dispatcher):
            f.enable_caching()
    _done = True
