"""What every tiny build shares: the output layout, the build's determinism, tokenizer training,
the decoder's sizes, supervised warm-start (SFT until the greedy accuracy enters a band), the
manifest and the report.

Every build (:mod:`async_rl.tiny.text`, :mod:`async_rl.tiny.vlm`) writes::

    out_dir/
      assets.json               manifest (seed, accuracy, hashes, sizes, versions, timings)
      model/                    Hugging Face directory that transformers and vLLM load
      data/train.jsonl data/val.jsonl          (EasyR1 rows; disjoint)

Same seed -> byte-identical tokenizer.json and identical weights hash: every random
choice flows from ``seed`` (Python RNG for data, torch RNG forked for init and sampling),
the data order is fixed, and the build runs with a fixed torch thread count (CPU
reductions may depend on it), restoring the caller's setting afterwards
(:func:`build_determinism`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch
import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenizer split: digits stay single tokens (\p{N}), which keeps numbers
# learnable digit by digit; the rest is the GPT-2 style word/punctuation split.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_CAP = 512  # BPE stops earlier when the task corpus has no more pairs to merge
MAX_MODEL_LEN = 512  # max_position_embeddings; prompts are ~17 tokens, answers ~4
# Fixed so CPU reductions, hence weights, are reproducible. One thread: the matrices are
# too small to gain from more (measured: 2 threads, same wall time, 1.4x the CPU), and
# spinning OpenMP threads slow down many-fold on a shared 2-core machine.
NUM_THREADS = 1
PASS_AT_K = 8  # samples per validation problem for the headroom estimate
T = TypeVar("T")


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start schedule (AdamW, linear warmup then constant lr)."""

    lr: float = 1e-3
    warmup_steps: int = 50
    batch_size: int = 32  # sequences per optimizer step
    eval_every: int = 10  # steps between greedy validation evaluations
    band: tuple[float, float] = (0.10, 0.60)  # accepted greedy val accuracy
    target: float = 0.25  # stop at the first evaluation at or above this
    max_steps: int = 3000
    eval_rows: int | None = None
    """Validation rows each evaluation and the pass@k estimate decode (None: all of the
    builder's). Short test builds set a few: an untrained model decodes to its budget."""

    def evaluated(self, rows: Sequence[T]) -> Sequence[T]:
        """The first :attr:`eval_rows` of ``rows`` (all when unset)."""
        return rows if self.eval_rows is None else rows[: self.eval_rows]


WARM_START = WarmStart()


@dataclass(frozen=True)
class TinyAssetsReport:
    """What ``build_tiny_assets`` produced. Accuracies are fractions in [0, 1] of the
    validation split; timings are wall-clock seconds."""

    out_dir: Path
    model_dir: Path
    data_dir: Path
    train_path: Path
    val_path: Path
    manifest_path: Path
    seed: int
    base_accuracy: float  # greedy exact match after the warm-start
    sampled_accuracy: float  # mean exact match of samples at temperature 1
    pass_at_k: float  # fraction of problems with >= 1 correct of PASS_AT_K samples
    sft_steps: int
    weights_sha256: str
    tokenizer_sha256: str
    vocab_size: int
    num_parameters: int
    timings_s: dict[str, float] = field(default_factory=dict)


def make_layout(out: Path) -> tuple[Path, Path]:
    """Create and return ``out/model`` and ``out/data``."""
    model_dir, data_dir = out / "model", out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    return model_dir, data_dir


@contextmanager
def build_determinism() -> Iterator[None]:
    """Run a build with ``NUM_THREADS`` torch threads and a forked torch RNG, restoring
    the caller's thread count and RNG state afterwards."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads_before)


def sample_stats(
    samples: Sequence[str], answers: Sequence[str], correct: Callable[[str, str], bool], k: int = PASS_AT_K
) -> tuple[float, float]:
    """``(mean accuracy of all samples, fraction of problems with >= 1 correct sample)`` of
    ``k`` samples per problem, grouped by problem (``samples[i * k : (i + 1) * k]`` answer
    ``answers[i]``), judged by ``correct(sample, answer)``."""
    if not answers or len(samples) != k * len(answers):
        raise ValueError(f"expected {k} samples for each of {len(answers)} problems (>= 1), got {len(samples)}")
    hits = [[correct(s, a) for s in samples[i * k : (i + 1) * k]] for i, a in enumerate(answers)]
    return sum(map(sum, hits)) / len(samples), sum(map(any, hits)) / len(answers)


def finish_build(
    out: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    base_accuracy: float,
    sampled_accuracy: float,
    pass_at_k: float,
    sft_steps: int,
    timings: dict[str, float],
    t_start: float,
    warm_start: WarmStart,
    task: dict[str, Any],
    sizes: dict[str, int],
    progress: Callable[[str], None],
    versions: dict[str, str] | None = None,
) -> TinyAssetsReport:
    """Save the warm-started model (with :func:`_generation_config`) into ``out/model``, set
    ``timings["total"]`` (seconds since ``t_start``, a ``time.perf_counter()`` reading), write
    the manifest (:func:`write_manifest`) and report the build; returns its report (paths
    of the standard layout, hashes read from the files, timings rounded to 10 ms)."""
    model_dir, data_dir = out / "model", out / "data"
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(model_dir)
    timings["total"] = time.perf_counter() - t_start
    report = TinyAssetsReport(
        out_dir=out,
        model_dir=model_dir,
        data_dir=data_dir,
        train_path=data_dir / "train.jsonl",
        val_path=data_dir / "val.jsonl",
        manifest_path=out / "assets.json",
        seed=seed,
        base_accuracy=base_accuracy,
        sampled_accuracy=sampled_accuracy,
        pass_at_k=pass_at_k,
        sft_steps=sft_steps,
        weights_sha256=weights_sha256(model_dir),
        tokenizer_sha256=hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest(),
        vocab_size=len(tokenizer),
        num_parameters=sum(p.numel() for p in model.parameters()),
        timings_s={k: round(v, 2) for k, v in timings.items()},
    )
    write_manifest(report, warm_start, task, sizes, versions)
    progress(
        f"[assets] base greedy val accuracy {base_accuracy:.1%} after {sft_steps} SFT steps "
        f"(T=1 sample accuracy {sampled_accuracy:.1%}, pass@{PASS_AT_K} {pass_at_k:.1%}); "
        f"{timings['total']:.1f}s total -> {out}"
    )
    return report


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 over the tensors of ``model.safetensors`` (name, dtype, shape, bytes, in
    name order): independent of the file's header layout."""
    tensors = safetensors.torch.load_file(Path(model_dir) / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_tokenizer(
    model_dir: Path,
    corpus: Sequence[str],
    special_tokens: Sequence[str],
    chat_template: str,
    max_len: int = MAX_MODEL_LEN,
) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE (Qwen2's digit-splitting pre-tokenizer, at most ``VOCAB_CAP``
    tokens) on ``corpus``, with ``special_tokens`` first (ids 0, 1, ...; the first is the pad
    token, the third the eos), save it into ``model_dir`` as a HF tokenizer with
    ``chat_template`` (written by hand so the files load in transformers 4.x and 5.x alike)
    and ``max_len`` (the model's context, tokens), and load it back."""
    if len(special_tokens) < 3:
        raise ValueError(f"need at least pad, start and eos special tokens, got {list(special_tokens)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_CAP,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer, length=len(corpus))
    tok.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": special_tokens[2],
        "pad_token": special_tokens[0],
        "chat_template": chat_template,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return AutoTokenizer.from_pretrained(model_dir)


def text_model_sizes(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The tiny decoder's sizes and special token ids, as config keyword arguments (the
    Qwen2 model's, and the vision-language model's Llama text model's)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim = 128 / 2 = 64, the smallest vLLM-CPU accepts
        num_key_value_heads=1,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _generation_config(tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    # Stop on <|im_end|> (end of turn) and <|endoftext|>, like Qwen's instruct models.
    return GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )


def sft_steps(
    model: torch.nn.Module,
    num_examples: int,
    batch_loss: Callable[[list[int]], torch.Tensor],
    seed: int,
    cfg: WarmStart = WARM_START,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Supervised steps, yielding ``(step, loss)`` after each (1-based, up to ``cfg.max_steps``):
    AdamW with ``cfg``'s linear warmup then constant lr, grad-norm clip 1, on batches of
    ``cfg.batch_size`` example indices (``batch_loss(indices) -> scalar loss``) drawn epoch by
    epoch from permutations seeded with ``seed``. Leaves the model in training mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
    )
    order_rng = torch.Generator().manual_seed(seed)
    order: list[int] = []
    model.train()
    for step in range(1, cfg.max_steps + 1):
        if len(order) < cfg.batch_size:  # new epoch: fresh permutation of the train split
            order = torch.randperm(num_examples, generator=order_rng).tolist()
        batch = order[: cfg.batch_size]
        del order[: cfg.batch_size]
        loss = batch_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        yield step, loss


def sft_until_band(
    model: torch.nn.Module,
    num_examples: int,
    batch_loss: Callable[[list[int]], torch.Tensor],
    accuracy: Callable[[], float],
    seed: int,
    progress: Callable[[str], None],
    cfg: WarmStart = WARM_START,
) -> tuple[int, float]:
    """:func:`sft_steps`, evaluating ``accuracy()`` (greedy validation accuracy, a fraction)
    every ``cfg.eval_every`` steps until it reaches ``cfg.target``; returns (steps, accuracy).

    Should an evaluation overshoot the band, the last in-band weights are restored; none in
    band within ``cfg.max_steps`` raises RuntimeError.
    """
    low, high = cfg.band
    in_band: tuple[int, float, dict[str, torch.Tensor]] | None = None
    step, acc = 0, float("nan")
    for step, loss in sft_steps(model, num_examples, batch_loss, seed, cfg):
        if step % cfg.eval_every:
            continue
        acc = accuracy()
        done = acc >= cfg.target
        if done or step % 50 == 0:
            progress(f"[assets] SFT step {step}: loss {loss.item():.3f}, greedy val acc {acc:.1%}")
        if acc > high:
            break
        if acc >= low:
            in_band = (step, acc, copy.deepcopy(model.state_dict()))
        if done:
            break
    if in_band is None:
        raise RuntimeError(
            f"warm-start never reached greedy val accuracy in [{low:.0%}, {high:.0%}] "
            f"within {cfg.max_steps} steps (last: {acc:.1%} at step {step})"
        )
    step, acc, state = in_band
    model.load_state_dict(state)
    return step, acc


def sft_batch(
    batch: Sequence[tuple[list[int], list[int]]], eos: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)``, each of shape [len(batch), longest prompt +
    completion + 1], of right-padded ``prompt + completion + [eos]`` sequences whose labels
    are -100 (no loss) except on the completion and eos."""
    seqs = [(p, c + [eos]) for p, c in batch]
    width = max(len(p) + len(c) for p, c in seqs)
    input_ids = torch.full((len(seqs), width), pad)
    labels = torch.full((len(seqs), width), -100)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor(c)
        attention_mask[i, :n] = 1
    return input_ids, attention_mask, labels


def write_manifest(
    report: TinyAssetsReport,
    warm_start: WarmStart,
    task: dict[str, Any],
    sizes: dict[str, int],
    versions: dict[str, str] | None = None,
) -> None:
    """Write ``report.manifest_path`` (JSON): the report (paths relative to the output
    directory), the task's description, split sizes, warm-start schedule and the library
    versions (``versions`` adds more)."""
    out = report.out_dir
    manifest = {
        key: (str(value.relative_to(out)) if isinstance(value, Path) else value)
        for key, value in asdict(report).items()
        if key not in ("out_dir", "manifest_path")
    }
    manifest.update(
        task=task,
        sizes=sizes,
        warm_start=asdict(warm_start),
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            **(versions or {}),
        },
    )
    report.manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
