"""nanoGPT's model and its ``shakespeare_char`` CPU recipe, re-implemented here as a reference.

This is OUR re-implementation, written for decoderlab's benchmarks from nanoGPT's documented
behaviour (github.com/karpathy/nanoGPT: ``model.py``, ``train.py``,
``config/train_shakespeare_char.py``, ``data/shakespeare_char/prepare.py``); no code is copied from
it. It reproduces what a run of

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

does, in one process and without files:

- the model: GPT-2 style, learned positions, LayerNorm without biases (``bias=False``), GELU MLP of
  width 4 x hidden, causal SDPA attention with one fused ``c_attn`` projection, tied embeddings,
  normal(0, 0.02) init with the residual projections ``c_proj`` at 0.02 / sqrt(2 x layers);
- the data: characters of Tiny Shakespeare, vocabulary = the sorted set of characters (65), the
  first 90% for training and the last 10% for validation;
- the recipe: random batches of ``batch_size`` windows of ``block_size`` tokens, AdamW (betas 0.9,
  0.99; weight decay 0.1 on parameters with >= 2 dimensions, none on the rest; torch's default
  implementation, which on CPU is the single-tensor loop), lr 1e-3 with 100 linear warm-up steps
  ``lr * (it + 1) / (warmup + 1)`` then cosine decay to 1e-4 at ``lr_decay_iters``, gradient
  clipping at norm 1.0, fp32. Like nanoGPT's loop it runs steps 0 .. max_iters inclusive and, before
  every step whose number is a multiple of ``eval_interval`` (0, 250, ..., 2000), estimates the train
  and val loss on ``eval_iters`` random batches each.

``run_nanogpt_recipe()`` runs it and returns wall time and losses; ``NanoGPT`` is the model the
speed benchmark times for "nanoGPT's throughput". With ``--nanogpt_dir PATH`` (or
``nanogpt_dir=``) the recipe instead builds the ``GPT`` class of a real nanoGPT checkout's
``model.py``, so the re-implementation can be checked against the original on your machine.

    python benchmarks/reference_nanogpt.py                   # the full recipe, about 2 minutes on 2 cores
    python benchmarks/reference_nanogpt.py --max_iters 100   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared data folder sits beside the checkout; resolved from here, never an absolute path.
DEFAULT_DATA_PATH = REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt"


# ----------------------------------------------------------------------------------------------
# Model


@dataclass
class NanoGPTConfig:
    """nanoGPT's GPTConfig fields, with the shakespeare_char CPU recipe's values as defaults."""

    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


class NanoGPTAttention(nn.Module):
    """Causal self-attention with q, k, v from one fused projection ``c_attn``."""

    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}.")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class NanoGPTMLP(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()  # exact erf GELU, as nanoGPT
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoGPTBlock(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoGPTAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoGPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` (same parameter names, so a real nanoGPT state dict loads into it).

    ``forward(idx, targets)`` returns ``(logits, loss)``: logits for every position when targets
    are given, else only for the last position, as nanoGPT does for sampling.
    """

    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([NanoGPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"Sequence length {T} is longer than block_size={self.config.block_size}.")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # (B, 1, V)
        logits = self.lm_head(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def load_nanogpt_model_class(nanogpt_dir: str | Path) -> tuple[type, type]:
    """(GPT, GPTConfig) from a real nanoGPT checkout's ``model.py``."""
    path = Path(nanogpt_dir) / "model.py"
    if not path.is_file():
        raise ValueError(f"--nanogpt_dir {nanogpt_dir}: no model.py there. Pass the root of a nanoGPT checkout.")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT, module.GPTConfig


def build_model(config: NanoGPTConfig, nanogpt_dir: str | Path | None = None) -> nn.Module:
    """Our ``NanoGPT``, or the original ``GPT`` when a checkout is given (both take the same fields)."""
    if nanogpt_dir is None:
        return NanoGPT(config)
    gpt_class, config_class = load_nanogpt_model_class(nanogpt_dir)
    return gpt_class(config_class(**asdict(config)))


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class CharData:
    """Tiny Shakespeare as character ids: nanoGPT's shakespeare_char preparation."""

    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (N_val,) int64
    chars: str  # id -> character

    @property
    def vocab_size(self) -> int:
        return len(self.chars)


def load_char_data(data_path: str | Path | None = None) -> CharData:
    """Vocabulary = sorted set of characters; the first 90% trains, the last 10% validates."""
    path = Path(data_path) if data_path is not None else DEFAULT_DATA_PATH
    if not path.is_file():
        raise ValueError(
            f"Tiny Shakespeare not found at {path}. Pass data_path= (or --data_path) pointing to input.txt "
            "(github.com/karpathy/char-rnn, data/tinyshakespeare/input.txt)."
        )
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_train = int(0.9 * len(ids))
    return CharData(train=ids[:n_train], val=ids[n_train:], chars=chars)


def get_batch(data: torch.Tensor, block_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs (B, T) and the same windows shifted by one as targets."""
    starts = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in starts])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in starts])
    return x, y


@torch.no_grad()
def windowed_val_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, block_size: int, batch_size: int = 64
) -> float:
    """Mean next-token loss over the whole split, cut into consecutive non-overlapping windows.

    Every token after the first is predicted exactly once, from the tokens before it in its window
    of ``block_size`` (the last window may be shorter). ``logits_fn`` maps ids (B, T) to logits
    (B, T, V); the loss is averaged over tokens, not windows.
    """
    inputs, targets = ids[:-1], ids[1:]
    n_full = len(inputs) // block_size
    total, count = 0.0, 0
    full_x = inputs[: n_full * block_size].view(n_full, block_size)
    full_y = targets[: n_full * block_size].view(n_full, block_size)
    chunks = [(full_x[i : i + batch_size], full_y[i : i + batch_size]) for i in range(0, n_full, batch_size)]
    if len(inputs) > n_full * block_size:  # the shorter tail window
        chunks.append((inputs[n_full * block_size :][None], targets[n_full * block_size :][None]))
    for x, y in chunks:
        logits = logits_fn(x)
        total += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1).to(logits.device), reduction="sum"
        ).item()
        count += y.numel()
    return total / count


# ----------------------------------------------------------------------------------------------
# The recipe


@dataclass
class NanoGPTRecipe:
    """config/train_shakespeare_char.py with the documented CPU overrides."""

    max_iters: int = 2000
    lr_decay_iters: int = 2000
    eval_interval: int = 250
    eval_iters: int = 20
    batch_size: int = 12
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337


def learning_rate_at(it: int, recipe: NanoGPTRecipe) -> float:
    """Linear warm-up, cosine decay to ``min_lr`` at ``lr_decay_iters``, then flat."""
    if it < recipe.warmup_iters:
        return recipe.learning_rate * (it + 1) / (recipe.warmup_iters + 1)
    if it >= recipe.lr_decay_iters:  # nanoGPT tests `>`; equal here gives min_lr too, without 0/0 when short
        return recipe.min_lr
    progress = (it - recipe.warmup_iters) / (recipe.lr_decay_iters - recipe.warmup_iters)
    return recipe.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (recipe.learning_rate - recipe.min_lr)


def make_optimizer(model: nn.Module, recipe: NanoGPTRecipe, **adamw_kwargs) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (parameters with >= 2 dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=(recipe.beta1, recipe.beta2), **adamw_kwargs)


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    data: CharData,
    block_size: int,
    recipe: NanoGPTRecipe,
    to_device: Callable = lambda batch: batch,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Mean loss over ``eval_iters`` random batches of each split, in eval mode (batches through ``to_device``,
    forward passes under ``autocast()``)."""
    model.eval()
    out = {}
    for split, ids in (("train", data.train), ("val", data.val)):
        losses = []
        for _ in range(recipe.eval_iters):
            with autocast():
                losses.append(model(*to_device(get_batch(ids, block_size, recipe.batch_size)))[1].item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def run_nanogpt_recipe(
    max_iters: int = 2000,
    *,
    lr_decay_iters: int | None = None,
    eval_interval: int = 250,
    eval_iters: int = 20,
    num_threads: int | None = 2,
    seed: int = 1337,
    model_config: NanoGPTConfig | None = None,
    data_path: str | Path | None = None,
    nanogpt_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    batch_size: int = 12,
    device: str = "cpu",
    dtype: str = "float32",
    compile_backend: str | None = None,
    log_interval: int = 1,
    data: CharData | None = None,
) -> dict:
    """Train nanoGPT's shakespeare_char CPU recipe and report its wall time and losses.

    The defaults are the CPU recipe; nanoGPT's GPU recipe (``config/train_shakespeare_char.py`` as written) is
    ``max_iters=5000, eval_iters=200, batch_size=64, log_interval=10, device="cuda", dtype="bfloat16",
    compile_backend="inductor"`` with ``NanoGPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384,
    dropout=0.2)``: batches pinned and copied without blocking, the forward passes under autocast to ``dtype``
    (``float32``: none), the model ``torch.compile``d with ``compile_backend`` (None: eager), fused AdamW on CUDA,
    and the loss read (a synchronisation) every ``log_interval`` steps, as nanoGPT's ``train.py`` does.

    ``lr_decay_iters`` defaults to ``max_iters`` (the documented command sets both to 2000).
    ``num_threads`` sets torch's intra-op threads for the run (restored afterwards); None leaves
    them. ``log`` receives nanoGPT-style progress lines (None: silent). ``data``: other character data than
    Tiny Shakespeare's nanoGPT split (``data_path`` is then not read); ``batch_size``: windows per step.

    Returns a JSON-serialisable dict:
        wall_time_s: the training loop including its periodic evaluations (what timing
            ``python train.py`` measures, minus start-up and data preparation);
        train_time_s: the same without the evaluations;
        val_loss, train_loss: the last periodic estimate (at step max_iters, before that step runs);
        val_loss_every_window: loss over the whole validation split in consecutive non-overlapping
            block_size windows (see ``windowed_val_loss``), computed after training, not timed in wall_time_s;
        window_eval_s: the time that computation took (not part of nanoGPT's own command);
        history: every periodic estimate; best_val_loss and best_iter: the lowest periodic validation estimate
        and its step (the checkpoint nanoGPT's Shakespeare config keeps); tokens_per_s: training tokens /
        train_time_s; plus the recipe, the model config, the parameter count, threads and torch version.
    """
    recipe = NanoGPTRecipe(
        max_iters=max_iters,
        lr_decay_iters=max_iters if lr_decay_iters is None else lr_decay_iters,
        eval_interval=eval_interval,
        eval_iters=eval_iters,
        seed=seed,
        batch_size=batch_size,
    )
    if recipe.max_iters < 0 or recipe.eval_interval < 1 or recipe.eval_iters < 1:
        raise ValueError(
            f"max_iters={max_iters} must be >= 0, eval_interval={eval_interval} and eval_iters={eval_iters} >= 1."
        )
    data = data if data is not None else load_char_data(data_path)
    config = model_config or NanoGPTConfig(vocab_size=data.vocab_size)
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        torch.manual_seed(recipe.seed)
        model = build_model(config, nanogpt_dir).to(device)
        optimizer = make_optimizer(model, recipe, **({"fused": True} if device == "cuda" else {}))
        trained = model if compile_backend is None else torch.compile(model, backend=compile_backend)
        autocast = (
            contextlib.nullcontext
            if dtype == "float32"
            else lambda: torch.autocast(device_type=device, dtype=getattr(torch, dtype))
        )
        if device == "cpu":
            to_device = lambda batch: batch
        else:  # nanoGPT's get_batch: pinned, copied without waiting
            to_device = lambda batch: tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)
        history, eval_time = [], 0.0
        x, y = to_device(get_batch(data.train, config.block_size, recipe.batch_size))
        start = time.perf_counter()
        for it in range(recipe.max_iters + 1):  # nanoGPT's loop runs steps 0 .. max_iters inclusive
            lr = learning_rate_at(it, recipe)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if it % recipe.eval_interval == 0:
                eval_start = time.perf_counter()
                losses = estimate_loss(trained, data, config.block_size, recipe, to_device, autocast)
                eval_time += time.perf_counter() - eval_start
                history.append({"iter": it, **losses})
                if log is not None:
                    log(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            with autocast():
                _, loss = trained(x, y)
            x, y = to_device(get_batch(data.train, config.block_size, recipe.batch_size))  # next batch, loss live
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if it % log_interval == 0:
                loss_value = loss.item()  # --log_interval=1 (the CPU recipe): nanoGPT reads the loss every step
                if log is not None:
                    log(f"iter {it}: loss {loss_value:.4f}")
        if device == "cuda":
            torch.cuda.synchronize()
        wall_time = time.perf_counter() - start
        model.eval()

        def window_logits(ids: torch.Tensor) -> torch.Tensor:
            with autocast():
                return model(ids.to(device), ids.to(device))[0]

        val_every_window = windowed_val_loss(window_logits, data.val, config.block_size)
        window_eval_time = time.perf_counter() - start - wall_time
    finally:
        torch.set_num_threads(previous_threads)
    train_time = wall_time - eval_time
    steps = recipe.max_iters + 1
    return {
        "implementation": f"nanoGPT model.py from {nanogpt_dir}" if nanogpt_dir else "decoderlab re-implementation",
        "wall_time_s": wall_time,
        "train_time_s": train_time,
        "eval_time_s": eval_time,
        "window_eval_s": window_eval_time,
        "steps": steps,
        "tokens_per_s": steps * recipe.batch_size * config.block_size / train_time,
        "val_loss": history[-1]["val"],
        "train_loss": history[-1]["train"],
        "val_loss_every_window": val_every_window,
        "history": history,
        "best_val_loss": min(h["val"] for h in history),
        "best_iter": min(history, key=lambda h: h["val"])["iter"],
        "recipe": asdict(recipe),
        "model_config": asdict(config),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_threads": num_threads if num_threads is not None else previous_threads,
        "torch_version": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_iters", type=int, default=2000)
    parser.add_argument("--eval_interval", type=int, default=250)
    parser.add_argument("--eval_iters", type=int, default=20)
    parser.add_argument("--num_threads", type=lambda v: None if v.lower() == "none" else int(v), default=2,
                        help="torch's intra-op threads; none leaves them")  # fmt: skip
    parser.add_argument("--data_path", type=Path, default=None, help="Tiny Shakespeare input.txt")
    parser.add_argument("--nanogpt_dir", type=Path, default=None, help="time a real nanoGPT checkout's model.py")
    parser.add_argument("--json_out", type=Path, default=None, help="also write the result here")
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")
    # nanoGPT's GPU recipe: --batch_size 64 --block_size 256 --n_layer 6 --n_head 6 --n_embd 384 --dropout 0.2
    # --max_iters 5000 --eval_iters 200 --log_interval 10 --device cuda --dtype bfloat16 --compile_backend inductor
    defaults = NanoGPTConfig()
    parser.add_argument("--batch_size", type=int, default=12)
    parser.add_argument("--block_size", type=int, default=defaults.block_size)
    parser.add_argument("--n_layer", type=int, default=defaults.n_layer)
    parser.add_argument("--n_head", type=int, default=defaults.n_head)
    parser.add_argument("--n_embd", type=int, default=defaults.n_embd)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--log_interval", type=int, default=1, help="read the loss every N steps")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="autocast")
    parser.add_argument("--compile_backend", default=None, help="torch.compile backend (default: eager, none)")
    args = parser.parse_args(argv)
    sizes = dict(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                 dropout=args.dropout)  # fmt: skip
    result = run_nanogpt_recipe(
        args.max_iters,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        num_threads=args.num_threads,
        data_path=args.data_path,
        nanogpt_dir=args.nanogpt_dir,
        log=None if args.quiet else print,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        compile_backend=args.compile_backend,
        log_interval=args.log_interval,
        model_config=NanoGPTConfig(vocab_size=load_char_data(args.data_path).vocab_size, **sizes),
    )
    print(
        f"{result['implementation']}: {result['steps']} steps in {result['wall_time_s']:.1f} s "
        f"({result['tokens_per_s']:.0f} training tokens/s), val loss {result['val_loss']:.4f}, "
        f"val loss over every {result['model_config']['block_size']}-token window {result['val_loss_every_window']:.4f}"
    )
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
