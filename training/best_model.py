"""The best model and early stopping: transformers' ``load_best_model_at_end`` and ``EarlyStoppingCallback``.

Each periodic evaluation (over ``max_eval_samples`` blocks, every ``eval_steps`` steps, and at the last step under
``load_best_model_at_end``) is compared with the best so far by ``metric_for_best_model``. The best value and its
step live in ``TrainState`` (so in every checkpoint: a resumed run knows the best so far), and with
``load_best_model_at_end`` the loop saves a checkpoint at each new best, which rotation never deletes while it is the
best; at the end the loop loads it back, so the final folder holds its weights. Every process computes the same
reduced metric, so every process takes the same decisions.
"""

import math
import pathlib

from .args import TrainConfig
from .checkpointing import TrainState


class BestModel:
    """Compares each periodic evaluation with the best so far and counts the evaluations without improvement."""

    def __init__(self, cfg: TrainConfig):
        self.metric = cfg.metric_for_best_model
        self.greater_is_better = cfg.greater_is_better
        self.patience = cfg.early_stopping_patience
        self.threshold = cfg.early_stopping_threshold
        self.keep_checkpoint = cfg.load_best_model_at_end
        self.enabled = cfg.load_best_model_at_end or cfg.early_stopping_patience is not None

    def update(self, state: TrainState, metrics: dict) -> bool:
        """Record the evaluation of ``state.step``; True when it is a new best. The patience counter restarts only
        at an improvement larger than the threshold (EarlyStoppingCallback's rule); a NaN is never the best."""
        value = metrics[self.metric]
        best = state.best_metric
        better = math.isfinite(value) and (best is None or (value > best if self.greater_is_better else value < best))
        if better and (best is None or abs(value - best) > self.threshold):
            state.early_stopping_patience_counter = 0
        else:
            state.early_stopping_patience_counter += 1
        if better:
            state.best_metric, state.best_global_step = value, state.step
        return better

    def should_stop(self, state: TrainState) -> bool:
        """Whether ``early_stopping_patience`` evaluations in a row did not improve on the best (by the threshold)."""
        return stopped_early(self.patience, state)


def stopped_early(patience: int | None, state: TrainState) -> bool:
    """Whether a run in ``state`` has used up its ``patience`` (None: no early stopping): it is finished."""
    return patience is not None and state.early_stopping_patience_counter >= patience


def best_checkpoint(output_dir, state: TrainState) -> pathlib.Path:
    """The checkpoint folder of the best step, or a ValueError when it is gone."""
    folder = pathlib.Path(output_dir) / f"step_{state.best_global_step}"
    if not folder.is_dir():
        raise ValueError(
            f"load_best_model_at_end: the best evaluation was at step {state.best_global_step} "
            f"({state.best_metric:.4f}), but its checkpoint {folder} is missing (deleted by hand?). Restore it, or "
            "run with --load_best_model_at_end false to keep the last step's weights."
        )
    return folder
