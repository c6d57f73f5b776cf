"""transformers.Trainer under the watchdog: a stuck rank named within a deadline, one rank's exception
ending the others (see [Note: the watchdog] in yafsdp/tools/watchdog.py; the mixin of
``yafsdp.trainer.YaFSDPTrainerMixin``)."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..tools.watchdog import Watchdog

__all__ = ["WatchdogMixin"]


class WatchdogMixin:
    """``train()`` and checkpoint saves of a Trainer under the watchdog; ``self._yafsdp_hang_timeout`` is
    set by the trainer's ``__init__`` (its ``hang_timeout``)."""

    _yafsdp_watchdog = None

    def train(self, *args, **kwargs):
        """Trainer.train under the watchdog ([Note: the watchdog] in yafsdp/tools/watchdog.py): a rank
        without progress for ``hang_timeout`` seconds after the first step (``TrainingArguments.ddp_timeout``
        before it, also the process group's timeout) is named and every process ends with status 4; an
        exception raised on one rank reaches the others, which end with status 1 instead of waiting in
        their next collective."""
        if dist.is_initialized():  # TrainingArguments.ddp_timeout, also where the script made the group itself
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.args.ddp_timeout))
        wd = self._yafsdp_watchdog = Watchdog(timeout=self._yafsdp_hang_timeout,
                                              startup_timeout=float(self.args.ddp_timeout)).start()
        callback = _watchdog_callback(wd)
        self.callback_handler.callbacks.insert(0, callback)  # first: a step is done before any user callback runs
        try:
            return super().train(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - published, then raised on as it was
            if dist.is_initialized() and dist.get_world_size() > 1:
                wd.fail(f"{type(e).__name__}: {e}", 1)
            raise
        finally:
            wd.stop()
            self._yafsdp_watchdog = None
            self.remove_callback(callback)

    def _save_checkpoint(self, *args, **kwargs):
        """A checkpoint's deadline is the longer one of saves (at least 1800 s)."""
        wd = self._yafsdp_watchdog
        if wd is None:
            return super()._save_checkpoint(*args, **kwargs)
        with wd.phase("save", timeout=max(1800.0, self._yafsdp_hang_timeout)):
            return super()._save_checkpoint(*args, **kwargs)


def _watchdog_callback(wd):
    """A TrainerCallback marking the watchdog's steps and phases (made here: transformers is imported on
    first use only)."""
    from transformers import TrainerCallback

    class WatchdogCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            wd.set_phase("train")

        def on_step_end(self, args, state, control, **kw):
            wd.step(state.global_step)

        def on_evaluate(self, args, state, control, **kw):
            wd.progress()

    return WatchdogCallback()
