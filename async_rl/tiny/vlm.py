"""Tiny vision-language assets: an Idefics3 (SmolVLM-shaped) model and a coloured-shapes task.

``build_vlm_assets(out_dir)`` (``build_tiny_assets(out_dir, task="vlm")``, ``async-rl
assets tiny --task vlm``) writes, deterministically and without network, the layout of
:mod:`async_rl.tiny.build`::

    out_dir/
      assets.json               manifest (seed, accuracy, hashes, sizes, versions, timings)
      model/                    Hugging Face directory that transformers and vLLM load:
        config.json generation_config.json model.safetensors
        tokenizer.json tokenizer_config.json         (byte-level BPE, chat template with image parts)
        preprocessor_config.json processor_config.json  (Idefics3Processor, no image splitting)
      data/train.jsonl data/val.jsonl   (EasyR1 rows: problem with one <image>, answer, images
                                         [one PNG data URI]; disjoint)

The task. Each image is 32x32 RGB: a plain background (white, black or grey), one square
(side 8-11 px) and one smaller disc (diameter 4-6 px) in another colour, not touching, in
6 colours (red, green, blue, yellow, purple, orange). Every row asks "<image>Which colour is
the square?"; the answer is the colour's bare name, so the built-in ``exact_match`` reward
scores it (and the build scores with that very function). 2000 training and 200 validation
rows, distinct (question, image) pairs; the PNGs travel as data URIs. ``ShapesTask`` can also
mix in "<image>How many squares?" (1-3 squares, answer "1"-"3"), off by default: this model
learns it from those rows alone (89% greedy after 700 SFT steps) but, mixed half and half
with the colour question, stays at 33-55% after 1000-1500 steps.

The model is a 0.63M-parameter Idefics3ForConditionalGeneration: a SigLIP vision tower
(patches of 8 px -> 16 patches, hidden 64, 1 head of head_dim 64, 1 layer), pixel shuffle
by 2 into 4 image tokens (``<image>`` x 4 between ``<fake_token_around_image><global-img>``
and ``<fake_token_around_image>``), and a Llama text model (hidden 128, 2 heads of head_dim 64
as vLLM-CPU requires, 1 KV head, 2 layers), tied embeddings, float32, 512 positions. Without
torchvision, transformers picks ``Idefics3ImageProcessorPil``. vLLM 0.32 (CPU) serves the
directory with ``{"prompt_token_ids": <one <image> per image>, "multi_modal_data": {"image":
PIL image}}``: its expanded prompt ids equal the processor's ``input_ids`` on all 200
validation rows and its greedy accuracy equals the manifest's (seed 0: 31.5% both). Read
with EasyR1's default ``data.min_pixels`` (262144), a 32x32 image is upscaled to 512x512 and
the processor shrinks it back (greedy 31.0% instead of 31.5%); ``data.min_pixels=1024``
keeps the images as built.

Warm start, in two parts. Greedy decoding finds the right colour long before sampling does:
trained directly, the model passes 30% greedy after ~40 steps while its T=1 samples are
still 3-5% right (the mass sits on junk tokens), a poor start for RL. So it first learns the
answer's form on mismatched pairs (``VisionWarmStart.format_steps`` = 100 steps, each prompt
shown another row's image: a colour word then <|im_end|>, greedy 15-18%), then SFT on the true
pairs (loss on the answer and <|im_end|>) until greedy validation accuracy enters [10%, 60%]
(target 30%). Seed 0: greedy 31.5% after 100 + 75 steps, T=1 sample accuracy 24.5%, pass@8
83.0%, 14 s in all on one core (seeds 1-3: greedy 30.0%, samples 18-21%, pass@8 78-85%).
The task is learnable from there: the same SFT continued reaches 54% greedy by step 250 of
the second part and 95.5% by step 350 (~25 s), then stays at 92-96%. RL headroom, measured
from the seed-0 assets with a plain on-policy GRPO loop in transformers (32 prompts x 8
samples per step, group-mean baseline, AdamW lr 3e-4, one core): greedy val accuracy 50%
after 200 steps (~100 s), 53.5% after 400-500, mean sample reward from ~0.3 to ~0.6.

T=1 samples can hold the image special tokens before <|im_end|> (3 of 1600 for the seed-0
model; ``<image>`` itself turned up in the GRPO loop's first 256): a response with ``<image>``
in it makes Idefics3's forward over prompt + response fail (more image positions than image
features), so a learner masks or suppresses those tokens (the loop above suppressed them).

Same seed -> the same data files (byte for byte), tokenizer and weights hash, as for the
text assets: every random choice flows from ``seed``, and the build runs under
:func:`~async_rl.tiny.build.build_determinism` (one torch thread, forked torch RNG).
"""

from __future__ import annotations

import base64
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import PIL
import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoProcessor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from async_rl.data.images import ImageError, decode_blob, image_blob
from async_rl.data.prompts import PromptFormatter
from async_rl.rewards.builtin import exact_match
from async_rl.tiny.addition import Row, write_jsonl
from async_rl.tiny.build import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    PASS_AT_K,
    TinyAssetsReport,
    WarmStart,
    build_determinism,
    finish_build,
    make_layout,
    sample_stats,
    sft_batch,
    sft_steps,
    sft_until_band,
    text_model_sizes,
    write_tokenizer,
)

FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE)
"""Ids 0-6: pad, turn start, eos (turn end), then the tokens Idefics3Processor looks up."""

# Qwen's chat format; a content list (EasyR1's vision-language messages) renders its text
# parts as they are and each {"type": "image"} part as one <image>, which the processor (or
# vLLM) expands into the image's tokens.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<image>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

IMAGE_SIZE = 32  # pixels, width = height
PATCH_SIZE = 8  # pixels: (32 / 8)^2 = 16 patches
SCALE_FACTOR = 2  # pixel shuffle: 16 patches -> 4 image tokens
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 50),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (255, 255, 255), "black": (20, 20, 20), "grey": (128, 128, 128)}
COLOUR_QUESTION = "<image>Which colour is the square?"
COUNT_QUESTION = "<image>How many squares?"

N_TRAIN, N_VAL = 2000, 200
MAX_NEW_TOKENS = 4  # an answer is one or two tokens, then <|im_end|>


@dataclass(frozen=True)
class VisionRow(Row):
    """One vision-language example in EasyR1's JSONL format: ``images`` holds data URIs,
    one per ``<image>`` in ``problem``."""

    images: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"problem": self.problem, "answer": self.answer, "images": list(self.images)}, ensure_ascii=False)


@dataclass(frozen=True)
class ShapesTask:
    """Scenes of squares and one disc on a plain background (see the module docstring).
    Sizes in pixels."""

    image_size: int = IMAGE_SIZE
    square_sides: tuple[int, int] = (8, 11)  # inclusive range of a square's side
    disc_sides: tuple[int, int] = (4, 6)  # inclusive range of the disc's diameter
    max_squares: int = 3
    count_share: float = 0.0  # fraction of "How many squares?" rows (see the module docstring)

    def sample(self, rng: random.Random) -> VisionRow:
        """One row drawn with ``rng``."""
        colours = list(COLOURS)
        background = rng.choice(list(BACKGROUNDS))
        if rng.random() < self.count_share:
            n = rng.randint(1, self.max_squares)
            squares = [rng.choice(colours) for _ in range(n)]
            disc = rng.choice(colours)
            problem, answer = COUNT_QUESTION, str(n)
        else:
            squares = [rng.choice(colours)]
            disc = rng.choice([c for c in colours if c != squares[0]])
            problem, answer = COLOUR_QUESTION, squares[0]
        image = self.draw(rng, background, squares, disc)
        return VisionRow(problem, answer, (data_uri(image),))

    def draw(self, rng: random.Random, background: str, squares: Sequence[str], disc: str) -> Image.Image:
        """The scene: the named background (:data:`BACKGROUNDS`), squares and disc
        (:data:`COLOURS`) at random sizes and places, 1 px apart at least (a shape that finds
        no free place in 50 tries restarts the layout; ValueError after 100 layouts)."""
        shapes = [("square", c) for c in squares] + [("disc", disc)]
        boxes: list[tuple[int, int, int]] = []  # x, y, side
        for _layout in range(100):
            boxes = []
            for kind, _ in shapes:
                for _try in range(50):
                    side = rng.randint(*(self.square_sides if kind == "square" else self.disc_sides))
                    x, y = rng.randint(0, self.image_size - side), rng.randint(0, self.image_size - side)
                    if all(x + side < bx or bx + bs < x or y + side < by or by + bs < y for bx, by, bs in boxes):
                        boxes.append((x, y, side))
                        break
                else:
                    break
            if len(boxes) == len(shapes):
                break
        else:
            raise ValueError(f"{len(shapes)} shapes do not fit apart in {self.image_size}x{self.image_size} px ({self})")
        image = Image.new("RGB", (self.image_size, self.image_size), BACKGROUNDS[background])
        pen = ImageDraw.Draw(image)
        for (kind, colour), (x, y, side) in zip(shapes, boxes):
            box = (x, y, x + side - 1, y + side - 1)
            if kind == "square":
                pen.rectangle(box, fill=COLOURS[colour])
            else:
                pen.ellipse(box, fill=COLOURS[colour])
        return image


TASK = ShapesTask()


def data_uri(image: Image.Image) -> str:
    """An RGB image as a PNG data URI."""
    return "data:image/png;base64," + base64.b64encode(image_blob(image).png).decode("ascii")


def row_image(row: VisionRow) -> Image.Image:
    """The (single) image of a row, decoded from its data URI (:class:`ImageError` if it has
    another number of images, or not a PNG data URI)."""
    if len(row.images) != 1 or not row.images[0].startswith("data:image/png;base64,"):
        raise ImageError(f"expected one PNG data URI in row {row.problem!r}, got {len(row.images)} images")
    return decode_blob(base64.b64decode(row.images[0].partition(",")[2]), IMAGE_SIZE * IMAGE_SIZE)


def make_vlm_splits(task: ShapesTask, seed: int, n_train: int, n_val: int) -> tuple[list[VisionRow], list[VisionRow]]:
    """Draw ``n_train + n_val`` distinct (question, image) rows with ``random.Random(seed)``;
    the first ``n_train`` are train, the rest validation, so the splits are disjoint."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    rows: list[VisionRow] = []
    while len(rows) < n_train + n_val:
        row = task.sample(rng)
        key = (row.problem, row.images[0])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def read_vision_jsonl(path: Path) -> list[VisionRow]:
    """Read rows written by :func:`~async_rl.tiny.addition.write_jsonl` from VisionRows."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            rows.append(VisionRow(str(obj["problem"]), str(obj["answer"]), tuple(obj.get("images", ()))))
    return rows


def is_exact_match(response: str, answer: str) -> bool:
    """The built-in ``exact_match`` reward's verdict (whitespace-normalised equality)."""
    return exact_match([{"response": response, "ground_truth": answer}])[0]["overall"] == 1.0


@dataclass(frozen=True)
class VisionWarmStart(WarmStart):
    """:class:`~async_rl.tiny.build.WarmStart` preceded by ``format_steps`` steps (same
    schedule, own optimizer) on mismatched pairs: each prompt shown another row's image, so
    the model learns the answer's form (a colour word, then <|im_end|>) and the colours'
    frequencies, but nothing about which image shows which colour."""

    format_steps: int = 100


VLM_WARM_START = VisionWarmStart(lr=1e-3, warmup_steps=50, batch_size=32, eval_every=5, band=(0.10, 0.60), target=0.30, max_steps=1000)


@dataclass(frozen=True)
class VisionExamples:
    """Processor-made inputs of rows: ``prompts[i]`` the expanded chat prompt ids (image
    tokens in place), ``answers[i]`` the answer's ids (no eos), ``pixel_values`` of shape
    [rows, 1 image, 3, IMAGE_SIZE, IMAGE_SIZE] (float32, normalised to [-1, 1])."""

    prompts: list[list[int]]
    answers: list[list[int]]
    pixel_values: torch.Tensor


def vision_examples(processor: ProcessorMixin, rows: Sequence[VisionRow]) -> VisionExamples:
    """The processor's ``input_ids`` and ``pixel_values`` of every row's prompt (rendered by
    :class:`~async_rl.data.prompts.PromptFormatter`, as a run renders it) and image.

    The images go through the image processor in one call; the prompt ids, which depend on
    the question only (every image is IMAGE_SIZE square, hence IMAGE_SEQ_LEN tokens), are
    computed once per distinct question."""
    tokenizer = processor.tokenizer
    formatter = PromptFormatter(tokenizer)
    images = [row_image(r) for r in rows]
    pixel_values = processor.image_processor([[im] for im in images], return_tensors="pt")["pixel_values"]
    prompts: dict[str, list[int]] = {}
    for row, image in zip(rows, images):
        if row.problem not in prompts:
            enc = processor(text=formatter.render(row.problem, len(row.images)), images=[image])
            prompts[row.problem] = list(enc["input_ids"][0])
    return VisionExamples(
        prompts=[prompts[r.problem] for r in rows],
        answers=[tokenizer.encode(r.answer, add_special_tokens=False) for r in rows],
        pixel_values=pixel_values.to(torch.float32),
    )


def _sft_loss(
    model: Idefics3ForConditionalGeneration,
    ex: VisionExamples,
    batch: Sequence[int],
    eos: int,
    pad: int,
    mismatched: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy over answer tokens + eos of the right-padded batch
    ``ex[batch]`` (input ids [len(batch), longest sequence], pixel values [len(batch), 1, 3, H, W]).
    ``mismatched``: example ``batch[j]`` gets the image of ``batch[j + 1]`` (cyclically)."""
    input_ids, attention_mask, labels = sft_batch([(ex.prompts[i], ex.answers[i]) for i in batch], eos, pad)
    pixel_values = ex.pixel_values[list(batch)]
    if mismatched:
        pixel_values = pixel_values.roll(-1, dims=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, labels=labels).loss


@torch.no_grad()
def generate_vlm_completions(
    model: Idefics3ForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    ex: VisionExamples,
    num_samples: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """Decode completions of all examples, batched by prompt length (so no padding).

    ``num_samples == 0``: one greedy completion per example. Otherwise ``num_samples``
    completions per example sampled at temperature 1 from torch's global RNG, grouped by
    example (example 0's samples first)."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(ex.prompts):
        groups.setdefault(len(p), []).append(i)
    per = max(1, num_samples)
    out: list[str] = [""] * (len(ex.prompts) * per)
    sampling: dict[str, Any] = (
        dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=num_samples)
        if num_samples
        else dict(do_sample=False)
    )
    was_training = model.training
    model.eval()
    for width, idx in groups.items():
        input_ids = torch.tensor([ex.prompts[i] for i in idx])
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=ex.pixel_values[idx],
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        texts = tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
        for k, i in enumerate(idx):
            out[i * per : (i + 1) * per] = texts[k * per : (k + 1) * per]
    model.train(was_training)
    return out


def vlm_greedy_accuracy(
    model: Idefics3ForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, ex: VisionExamples, rows: Sequence[VisionRow]
) -> float:
    """Fraction of rows whose greedy completion the ``exact_match`` reward accepts."""
    completions = generate_vlm_completions(model, tokenizer, ex)
    return sum(is_exact_match(c, r.answer) for c, r in zip(completions, rows)) / len(rows)


def build_vlm_assets(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    warm_start: WarmStart | None = None,
) -> TinyAssetsReport:
    """Build the tiny vision-language assets into ``out_dir`` (created; existing files
    overwritten). ``warm_start`` None: :data:`VLM_WARM_START`; a plain
    :class:`~async_rl.tiny.build.WarmStart` skips the answer-format steps."""
    cfg = warm_start or VLM_WARM_START
    format_steps = cfg.format_steps if isinstance(cfg, VisionWarmStart) else 0
    out = Path(out_dir)
    model_dir, data_dir = make_layout(out)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with build_determinism():
        t0 = time.perf_counter()
        train, val = make_vlm_splits(TASK, seed, N_TRAIN, N_VAL)
        write_jsonl(train, data_dir / "train.jsonl")
        write_jsonl(val, data_dir / "val.jsonl")
        timings["data"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        processor = build_processor(model_dir, train)
        tokenizer = processor.tokenizer
        timings["tokenizer"] = time.perf_counter() - t0
        progress(f"[assets] tokenizer: {len(tokenizer)} tokens, {type(processor.image_processor).__name__} -> {model_dir}")

        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(vlm_config(tokenizer))
        num_params = sum(p.numel() for p in model.parameters())
        progress(f"[assets] model: Idefics3, {num_params / 1e6:.2f}M parameters")

        t0 = time.perf_counter()
        evaluated = cfg.evaluated(val)
        train_ex, val_ex = vision_examples(processor, train), vision_examples(processor, evaluated)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        for step, loss in sft_steps(
            model,
            len(train),
            lambda batch: _sft_loss(model, train_ex, batch, eos, pad, mismatched=True),
            seed + 1,
            replace(cfg, max_steps=format_steps),
        ):
            if step == format_steps:
                acc = vlm_greedy_accuracy(model, tokenizer, val_ex, evaluated)
                progress(f"[assets] answer-format SFT step {step}: loss {loss.item():.3f}, greedy val acc {acc:.1%}")
        steps, base_acc = sft_until_band(
            model,
            len(train),
            lambda batch: _sft_loss(model, train_ex, batch, eos, pad),
            lambda: vlm_greedy_accuracy(model, tokenizer, val_ex, evaluated),
            seed,
            progress,
            cfg,
        )
        steps += format_steps
        timings["warm_start"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        samples = generate_vlm_completions(model, tokenizer, val_ex, num_samples=PASS_AT_K)
        sampled_acc, pass_at_k = sample_stats(samples, [r.answer for r in evaluated], is_exact_match)
        timings["pass_at_k"] = time.perf_counter() - t0

        return finish_build(
            out,
            model,
            tokenizer,
            seed=seed,
            base_accuracy=base_acc,
            sampled_accuracy=sampled_acc,
            pass_at_k=pass_at_k,
            sft_steps=steps,
            timings=timings,
            t_start=t_start,
            warm_start=cfg,
            task=_task_record(),
            sizes={"train": N_TRAIN, "val": N_VAL},
            progress=progress,
            versions={"pillow": PIL.__version__},
        )


def _task_record() -> dict[str, Any]:
    """The coloured-shapes task as the manifest records it: its parameters, colours, backgrounds and questions."""
    questions = [COLOUR_QUESTION] + ([COUNT_QUESTION] if TASK.count_share else [])
    return {"name": "vlm", **asdict(TASK), "colours": list(COLOURS), "backgrounds": list(BACKGROUNDS), "questions": questions}


def build_processor(model_dir: Path, train: Sequence[VisionRow]) -> ProcessorMixin:
    """Write the tokenizer (BPE trained on the training split's text) and the processor's
    configs into ``model_dir`` and load them back as an Idefics3Processor."""
    corpus = [f"user\n{r.problem.replace(IMAGE, '')}\nassistant\n{r.answer}\n" for r in train]
    write_tokenizer(model_dir, corpus, SPECIAL_TOKENS, VLM_CHAT_TEMPLATE)
    image_processor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "resample": 1,  # PIL's LANCZOS, as SmolVLM
        "do_image_splitting": False,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}
    for name, obj in (("preprocessor_config.json", image_processor), ("processor_config.json", processor)):
        (model_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return AutoProcessor.from_pretrained(model_dir)


def vlm_config(tokenizer: PreTrainedTokenizerBase) -> Idefics3Config:
    """The tiny Idefics3's configuration (sizes in the module docstring); the text model
    is the text assets' decoder (:func:`~async_rl.tiny.build.text_model_sizes`)."""
    return Idefics3Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=1,  # head_dim 64
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        text_config=dict(model_type="llama", **text_model_sizes(tokenizer)),
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
