"""Which windows of the training text each step trains on: the sampler, apart from how the tokens are stored.

``TrainConfig.window_sampling`` picks one (``docs/guides/data.md`` measures them against each other):

- ``blocks``: the text cut once into fixed blocks of ``block_size``, shuffled every pass (``data.BlockBatches``).
  Every window starts at a multiple of ``block_size``: over 80 passes the model sees the same few thousand windows
  80 times each, and overfits them. Right for a corpus seen about once.
- ``random``: nanoGPT's ``get_batch``: each window of a global batch starts at an offset drawn uniformly from all
  of them, with replacement (``RandomOffsets``).
- ``shifted``: each pass cuts the text into blocks from a random offset of its own and shuffles them: every token
  at most once per pass, the block boundaries moving from pass to pass (``ShiftedBlocks``).
- ``permutation``: every offset exactly once per pass over all of them, in a seeded random order: random offsets
  without replacement (``OffsetPermutation``; a pass holds ``block_size`` times the text's tokens).

A sampler is a function of the global batch index only: ``starts(b)`` gives the first token of each of the
``global_batch_size`` windows of global batch ``b``, drawn by a generator seeded with (seed, pass) or (seed, batch).
So a resume at step k computes step k's windows without replaying the ones before it, and every process computes
the same global batch and takes its own rows of it (``WindowBatches``): another number of processes at the same
global batch continues exactly.

Windows are read from ``TokenWindows``: the training tokens as one flat sequence (an in-memory tensor, or the
prepared shards' memory maps one after the other). A window is ``block_size`` tokens that are both the inputs and
the labels (the model shifts them), as a fixed block is. Only training tokens are in it, so no window reaches
into the validation text.
"""

from collections.abc import Iterator

import numpy as np
import torch

MAX_PERMUTED_OFFSETS = 1 << 28  # 2 GiB of int64 offsets per pass: beyond it, "permutation" is refused


class TokenWindows:
    """Training tokens as one flat sequence, read as windows: ``read(starts, size)`` is the (len(starts), size)
    int64 tensor of the windows starting at ``starts``. ``pieces`` are 1-D arrays or tensors (one in-memory
    tensor, or prepared shards through np.memmap) read one after the other; a window may span two of them, as a
    fixed block never does, but the documents in them are separated by end-of-text tokens either way."""

    def __init__(self, pieces: list):
        self.pieces = [piece.numpy() if isinstance(piece, torch.Tensor) else piece for piece in pieces]
        self.starts = np.cumsum([0] + [len(piece) for piece in self.pieces])  # (P + 1,): first token of each

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor) -> "TokenWindows":
        """The tokens of packed (N, T) blocks, in their order (``data.pack`` cut them from consecutive text)."""
        return cls([blocks.reshape(-1)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, starts: np.ndarray, size: int) -> torch.Tensor:
        if len(self.pieces) == 1:
            rows = np.asarray(self.pieces[0][starts[:, None] + np.arange(size)], dtype=np.int64)  # (B, size)
            return torch.from_numpy(rows)
        out = np.empty((len(starts), size), dtype=np.int64)
        for row, start in enumerate(starts):
            filled, position = 0, int(start)
            while filled < size:
                piece = int(np.searchsorted(self.starts, position, side="right")) - 1
                offset = position - int(self.starts[piece])
                part = self.pieces[piece][offset : offset + size - filled]
                out[row, filled : filled + len(part)] = part
                filled, position = filled + len(part), position + len(part)
        return torch.from_numpy(out)


class RandomOffsets:
    """nanoGPT's windows: global batch ``b`` draws ``global_batch_size`` offsets uniformly from every window's,
    with replacement, from a generator seeded by (seed, b)."""

    def __init__(self, n_tokens: int, block_size: int, global_batch_size: int, seed: int):
        self.n_offsets, self.global_batch_size, self.seed = n_tokens - block_size + 1, global_batch_size, seed

    def starts(self, batch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, batch])
        return rng.integers(0, self.n_offsets, self.global_batch_size)


class PassSampler:
    """A sampler whose windows come in passes of ``batches_per_pass`` global batches, each pass's order drawn once
    from a generator seeded by (seed, pass) by ``pass_starts`` and kept while the pass lasts."""

    batches_per_pass: int

    def __init__(self, seed: int, global_batch_size: int):
        self.seed, self.global_batch_size = seed, global_batch_size
        self.current: tuple[int, np.ndarray] | None = None  # (pass, its window starts in order)

    def pass_starts(self, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def starts(self, batch: int) -> np.ndarray:
        pass_index, index = divmod(batch, self.batches_per_pass)
        if self.current is None or self.current[0] != pass_index:
            self.current = (pass_index, self.pass_starts(np.random.default_rng([self.seed, pass_index])))
        first = index * self.global_batch_size
        return self.current[1][first : first + self.global_batch_size]


class ShiftedBlocks(PassSampler):
    """Each pass cuts the text into ``n_blocks`` consecutive blocks from an offset of its own and shuffles them.
    Every pass has as many blocks as any offset in ``[0, block_size)`` leaves room for; the tokens they leave
    (``spare``: from block_size - 1 to 2 x block_size - 2) are split between the text's head and tail by an offset
    drawn in ``[0, spare]``, so every token, the last one too, is in some pass's blocks. Blocks left over after a
    pass's last full global batch wait for the next pass, as ``BlockBatches``' do."""

    def __init__(self, n_tokens: int, block_size: int, global_batch_size: int, seed: int):
        super().__init__(seed, global_batch_size)
        self.block_size = block_size
        self.n_blocks = (n_tokens - block_size + 1) // block_size
        self.spare = n_tokens - self.n_blocks * block_size
        self.batches_per_pass = self.n_blocks // global_batch_size

    def pass_starts(self, rng: np.random.Generator) -> np.ndarray:
        offset = rng.integers(0, self.spare + 1)
        return offset + rng.permutation(self.n_blocks) * self.block_size


class OffsetPermutation(PassSampler):
    """Every offset once per pass, in a random order drawn for that pass: random offsets without replacement."""

    def __init__(self, n_tokens: int, block_size: int, global_batch_size: int, seed: int):
        super().__init__(seed, global_batch_size)
        self.n_offsets = n_tokens - block_size + 1
        if self.n_offsets > MAX_PERMUTED_OFFSETS:
            raise ValueError(
                f"window_sampling='permutation' keeps a permutation of all {self.n_offsets:,} offsets of the "
                f"training text in memory, more than {MAX_PERMUTED_OFFSETS:,}. Use window_sampling 'random' or "
                "'shifted', which draw their windows without one."
            )
        self.batches_per_pass = self.n_offsets // global_batch_size

    def pass_starts(self, rng: np.random.Generator) -> np.ndarray:
        return rng.permutation(self.n_offsets)


SAMPLERS = {"random": RandomOffsets, "shifted": ShiftedBlocks, "permutation": OffsetPermutation}


class WindowBatches:
    """Endless batches of windows at any offset of the training tokens, drawn by ``SAMPLERS[sampling]``; seeded,
    sharded over processes, resumable at any batch, as ``data.BlockBatches`` is for fixed blocks.

    Global batch ``b`` is the windows at ``sampler.starts(b)``; process ``r`` takes rows
    ``[r * batch_size, (r + 1) * batch_size)`` of it. ``batches_per_epoch`` is the number of global batches that
    hold as many tokens as the text (what ``num_train_epochs`` counts). A checkpoint records the sampling, the
    global batch, the number of tokens and the seed (``state_dict``); a resume with another number of processes
    at the same global batch continues exactly, and any other change is refused, naming it (``load_state_dict``).
    """

    kind = "windows"

    def __init__(
        self,
        tokens: TokenWindows,
        sampling: str,
        block_size: int,
        batch_size: int,
        seed: int,
        process_index: int = 0,
        num_processes: int = 1,
    ):
        if sampling not in SAMPLERS:
            raise ValueError(f"window_sampling={sampling!r} draws no windows; choose one of {sorted(SAMPLERS)}.")
        self.tokens, self.sampling, self.block_size, self.batch_size, self.seed = (
            tokens, sampling, block_size, batch_size, seed
        )  # fmt: skip
        self.process_index, self.global_batch_size = process_index, batch_size * num_processes
        n_tokens = len(tokens)
        if n_tokens < block_size:
            raise ValueError(
                f"The training text holds {n_tokens} tokens, fewer than one window of block_size={block_size}. "
                "Lower --block_size or give more text."
            )
        self.sampler = SAMPLERS[sampling](n_tokens, block_size, self.global_batch_size, seed)
        if getattr(self.sampler, "batches_per_pass", 1) == 0:
            raise ValueError(
                f"With {n_tokens} training tokens, window_sampling={sampling!r} gets fewer windows of "
                f"block_size={block_size} per pass than one global batch of {self.global_batch_size} "
                f"({batch_size} per process x {num_processes} processes). Lower the batch size or block_size, give "
                "more text, or use window_sampling 'random'."
            )
        self.batches_per_epoch = max(1, n_tokens // (self.global_batch_size * block_size))

    def state_dict(self, consumed: int) -> dict:
        """What a checkpoint after ``consumed`` micro-batches must match to continue exactly (the step says where)."""
        return {"kind": self.kind, "window_sampling": self.sampling,
                "num_processes": self.global_batch_size // self.batch_size,
                "global_batch_size": self.global_batch_size, "tokens": len(self.tokens), "seed": self.seed}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        check_sampling(state, self.sampling)
        now = {"global_batch_size": self.global_batch_size, "tokens": len(self.tokens), "seed": self.seed}
        check_same_position(state, now, "windows")

    def iterate(self, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        first = self.process_index * self.batch_size
        for batch in range(start, 1 << 62):
            starts = self.sampler.starts(batch)[first : first + self.batch_size]
            input_ids = self.tokens.read(starts, self.block_size)  # (B, T)
            yield {"input_ids": input_ids, "labels": input_ids}


def check_sampling(state: dict, sampling: str) -> None:
    """Refuse a checkpoint whose batches were drawn another way (fixed blocks or another ``window_sampling``): the
    same step would be other windows."""
    saved = state.get("window_sampling", "blocks" if state.get("kind") == "blocks" else None)
    if saved != sampling:
        drawn = f"window_sampling={saved!r}" if saved is not None else f"{state.get('kind')} data"
        raise ValueError(
            f"The checkpoint's batches were drawn with {drawn} and this run's with window_sampling={sampling!r}: "
            f"its position in the data does not carry over. Resume with --window_sampling {saved or 'blocks'}, or "
            "start a new run."
        )


def check_same_position(state: dict, now: dict, unit: str) -> None:
    """Refuse a checkpoint's data position (``state``) whose global batch size, data size or seed differ from this
    run's (``now``): the same step would be other ``unit`` ("windows", "blocks"). Names each value that differs."""
    if differ := {key: (state[key], value) for key, value in now.items() if state[key] != value}:
        listed = ", ".join(f"{key} {old} in the checkpoint, {new} now" for key, (old, new) in differ.items())
        raise ValueError(
            f"The checkpoint's data position does not carry over to this run ({listed}): the same step would be "
            f"other {unit}. Resume with the checkpoint's data, seed and global batch size "
            "(per_device_train_batch_size x processes)."
        )
