"""The data a ``harts-train`` run trains on: a rollout file's steps (:class:`FileData`) or the
synthetic step (:class:`SyntheticData`), each with a fingerprint saved with checkpoints (a resumed
run continues its data position only on the same data). :func:`load_data` reads and checks the whole
source against the model's vocabulary and the loss before any model work."""

from __future__ import annotations

import os

from harts_runtime.errors import InvalidInputError, UsageError

__all__ = ["FileData", "SyntheticData", "load_data", "synthetic_step"]


class _Source:
    """A data source of :func:`harts_runtime.trainer.job.run_job` over ``step(i)``: step ``k`` trains
    on step ``position % num_steps``; the position advances by one per step (saved with the
    checkpoint)."""

    position = 0
    num_steps = 1
    key = None

    def step(self, i: int):
        raise NotImplementedError

    def next_step(self, engine):
        batch, self.key = self.step(self.position % self.num_steps)
        self.position += 1
        return batch

    def record(self, step: int, result, report, seconds: dict) -> dict:
        from harts_runtime.trainer.loop import step_record

        return step_record(step, self.key, result, report, seconds["train"])


class FileData(_Source):
    """A rollout file's steps (:class:`harts_runtime.rollout_files.RolloutFile`)."""

    def __init__(self, rf):
        self.rf = rf
        self.num_steps = rf.num_steps
        self.fingerprint = {
            "kind": "file",
            "path": os.path.abspath(rf.path),
            "sha256": rf.sha256,
            "steps": rf.num_steps,
        }

    def step(self, i: int):
        """``(StepInputs, key)`` of the file's step ``i`` (key: its ``step`` value, else ``i``)."""
        key = self.rf.step_keys[i] if self.rf.step_keys is not None else i
        return self.rf.steps[i], key

    def longest(self) -> tuple[int, str]:
        """The longest trajectory's length, and which step holds it."""
        best = (0, "")
        for i, s in enumerate(self.rf.steps):
            n = int(s.lengths.max())
            if n > best[0]:
                key = self.rf.step_keys[i] if self.rf.step_keys is not None else None
                best = (n, f"step {key}" if key is not None else "the file's one step")
        return best

    def describe(self) -> str:
        """One line: the file, its trajectories, tokens and steps."""
        rf = self.rf
        tokens = sum(int(s.offsets[-1]) for s in rf.steps)
        text = (
            f"data: {rf.path} ({rf.format}): {rf.rows:,} trajectories, {tokens:,} tokens in {rf.num_steps} "
            f"step{'s' if rf.num_steps != 1 else ''}"
            + (" (by its 'step' key)" if rf.step_keys is not None else "")
            + ("; ref_logprobs" if rf.has_ref_logprobs else "; no ref_logprobs")
        )
        if rf.ignored:
            text += f"; ignored keys: {', '.join(rf.ignored)}"
        return text

    @staticmethod
    def same(a: dict, b: dict) -> bool:
        """Whether two fingerprints are of the same file contents."""
        return a.get("kind") == "file" and b.get("kind") == "file" and a.get("sha256") == b.get("sha256")


class SyntheticData(_Source):
    """The synthetic step (``--preset``), the same every step."""

    def __init__(self, step, fingerprint: dict):
        self.inputs = step
        self.num_steps = 1
        self.fingerprint = fingerprint

    def step(self, i: int):
        """``(StepInputs, 0)``."""
        return self.inputs, 0

    def longest(self) -> tuple[int, str]:
        """The longest trajectory's length, and where it is."""
        return int(max(self.inputs.batch.lengths)), "the synthetic step"

    def describe(self) -> str:
        """One line: the preset, its trajectories and token counts."""
        b = self.inputs.batch
        f = self.fingerprint
        return (
            f"batch: preset={f['preset']} seed={f['seed']} trajectories={b.num_trajectories} "
            f"S={b.semantic_tokens:,} C={b.compact_tokens:,} S/C={b.compression:.2f}"
        )

    @staticmethod
    def same(a: dict, b: dict) -> bool:
        """Whether two fingerprints are of the same synthetic step."""
        return a == b


def load_data(args, vocab: int, cpu: bool, loss_cfg):
    """The run's data: ``--data``'s file read and checked against ``vocab`` (and, when the loss
    has a KL penalty, for ``ref_logprobs`` in every row), else the synthetic ``--preset`` step.
    A bad file raises :class:`~harts_runtime.rollout_files.RolloutFileError` naming the line and
    field."""
    if args.data is not None:
        from harts_runtime.rollout_files import RolloutFileError, read_rollout_file

        try:
            rf = read_rollout_file(args.data, vocab)
        except InvalidInputError as e:
            if isinstance(e, RolloutFileError) or e.field != "data":
                raise
            raise UsageError(f"--{e}", "--data") from None
        if loss_cfg.kl_coef and not rf.has_ref_logprobs:
            raise RolloutFileError(
                rf.path,
                None,
                "ref_logprobs",
                f"the loss has a KL penalty (kl_coef={loss_cfg.kl_coef:g}"
                + (", grpo's default" if args.kl_coef is None else "")
                + ") and needs ref_logprobs in every row; add them or pass --kl-coef 0",
            )
        return FileData(rf)
    max_len = args.max_len if args.max_len is not None else (1024 if cpu else None)
    step = synthetic_step(args.preset, args.seed, vocab, max_len, args.objective)
    step.loss_config = loss_cfg
    fp = {"kind": "synthetic", "preset": args.preset, "seed": args.seed, "max_len": max_len, "vocab": vocab}
    return SyntheticData(step, fp)


def synthetic_step(
    preset: str, seed: int, vocab: int, max_len: int | None = None, objective: str = "grpo", **shape
):
    """:class:`StepInputs` of a ``harts_planner.synth`` preset (tokens in ``[0, vocab)``,
    trajectories capped at ``max_len`` tokens; ``shape`` overrides preset fields, e.g.
    :data:`harts_runtime.demo.DEMO_TREES`) with synthetic GRPO/PPO metadata. A preset with more trees than the
    vocabulary has tokens (each tree starts with its own) is capped at ``vocab`` trees (swe-like's
    up to 1,000 trees on the 512-token debug model)."""
    from harts_planner import synth
    from harts_planner.batch import RolloutBatch
    from harts_runtime.step_inputs import StepInputs

    over = {"vocab_size": vocab, **shape}
    if max_len is not None:
        over["max_trajectory_tokens"] = max_len
    if "trees" not in shape and preset in synth.PRESETS:
        lo, hi = synth.PRESETS[preset].trees  # each tree starts with its own token: at most vocab trees
        if hi > vocab:
            over["trees"] = (min(lo, vocab), vocab)
    sb = synth.generate(preset, seed, **over)
    batch = RolloutBatch.from_arrays(sb.tokens, sb.offsets, sb.tree_ids)
    return StepInputs.synthetic(batch, seed, objective, vocab_size=vocab)
