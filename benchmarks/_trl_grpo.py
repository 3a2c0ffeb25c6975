"""TRL's side of ``benchmarks/vs_trl.py``: the quickstart task trained by TRL's ``GRPOTrainer``,
with greedy validation at a fixed cadence. Runs in TRL's own venv (``benchmarks/vs_trl_env.sh``),
never in async-rl's: its only import of ours is ``async_rl.rewards`` (the repository root on
``PYTHONPATH``; it needs ``msgspec`` there), so the reward and the rule that a validation answer
is solved are async-rl's own.

    TRL_VENV/bin/python benchmarks/_trl_grpo.py SETTINGS.json RESULT.json

SETTINGS (written by vs_trl.py): ``model_dir``, ``train_file``, ``val_file``, ``prompt_key``,
``answer_key``, ``reward`` (``rollout.reward.function``), ``max_new_tokens``, ``val_every``
(optimizer steps), ``threads`` (torch intra-op threads) and ``grpo``: ``GRPOConfig`` keyword
arguments. RESULT: ``t0`` (``time.time()`` when training started, after the model load and the
base validation), ``train_wall_s`` (from ``t0`` to the last step, validations included),
``eval_s`` (of which validating), ``steps``, ``samples`` (completions trained on), ``val`` (per
point: ``version`` = optimizer steps, ``elapsed_s`` since ``t0`` when the validation ended,
``wall_s``, ``greedy`` accuracy) and the ``versions`` of TRL, transformers and torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from async_rl.rewards import load_reward_function, score_output

EVAL_BATCH = 200
"""Validation prompts per ``generate`` call (the assets' 200 rows: one call)."""


def read_rows(path: str, prompt_key: str, answer_key: str) -> list[dict[str, str]]:
    """JSONL rows as TRL's conversational prompts: ``prompt`` (one user message, rendered by the
    tokenizer's chat template with the generation prompt, as async-rl renders it) and ``answer``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{"prompt": [{"role": "user", "content": r[prompt_key]}], "answer": str(r[answer_key])} for r in rows]


class ScoredReward:
    """async-rl's reward function by name, in TRL's interface: one float per completion."""

    __name__ = "async_rl_reward"  # TRL names the reward's metrics after it

    def __init__(self, name: str):
        self.fn = load_reward_function(name)

    def scores(self, texts: list[str], answers: list[str], lengths: list[int]):
        """async-rl Scores of ``texts`` against ``answers`` (batch interface, as the reward pool calls it)."""
        outs = self.fn([{"response": t, "response_length": n, "ground_truth": a} for t, n, a in zip(texts, lengths, answers)])
        return [score_output(o) for o in outs]

    def __call__(self, completions, answer, completion_ids, **_) -> list[float]:
        texts = [c[-1]["content"] for c in completions]
        return [s.reward for s in self.scores(texts, answer, [len(ids) for ids in completion_ids])]


class GreedyValidation(TrainerCallback):
    """Greedy accuracy on the validation rows before training (the base, not timed) and every
    ``every`` optimizer steps (timed: its seconds count in the curve, as async-rl's do)."""

    def __init__(self, rows: list[dict], tokenizer, reward: ScoredReward, max_new_tokens: int, every: int):
        self.rows, self.reward, self.every, self.max_new_tokens = rows, reward, every, max_new_tokens
        self.tokenizer = tokenizer
        self.val: list[dict] = []
        self.t0 = 0.0
        self.eval_s = 0.0

    def accuracy(self, model) -> float:
        was_training = model.training
        model.eval()
        solved = 0
        with torch.no_grad():
            for i in range(0, len(self.rows), EVAL_BATCH):
                batch = self.rows[i:i + EVAL_BATCH]
                enc = self.tokenizer.apply_chat_template([r["prompt"] for r in batch], add_generation_prompt=True, padding=True,
                                                         return_tensors="pt", return_dict=True)
                out = model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                     eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id)
                new = out[:, enc["input_ids"].shape[1]:]
                lengths = [int((ids != self.tokenizer.pad_token_id).sum()) for ids in new]
                texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
                solved += sum(s.correct for s in self.reward.scores(texts, [r["answer"] for r in batch], lengths))
        model.train(was_training)
        return solved / len(self.rows)

    def _point(self, step: int, model) -> None:
        start = time.time()
        greedy = self.accuracy(model)
        now = time.time()
        if step:
            self.eval_s += now - start
        self.val.append({"version": step, "elapsed_s": round(now - self.t0, 1) if step else 0.0, "wall_s": now, "greedy": greedy})
        print(f"validation at step {step}: greedy {greedy:.3f} ({now - start:.1f} s)", flush=True)

    def on_train_begin(self, args, state, control, model=None, **_):
        self._point(0, model)
        self.t0 = time.time()

    def on_step_end(self, args, state, control, model=None, **_):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._point(state.global_step, model)


def main() -> None:
    settings = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(settings["threads"])
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"], padding_side="left")
    reward = ScoredReward(settings["reward"])
    keys = settings["prompt_key"], settings["answer_key"]
    train = Dataset.from_list(read_rows(settings["train_file"], *keys))
    validation = GreedyValidation(read_rows(settings["val_file"], *keys), tokenizer, reward, settings["max_new_tokens"], settings["val_every"])
    config = trl.GRPOConfig(**settings["grpo"])
    trainer = trl.GRPOTrainer(model=settings["model_dir"], reward_funcs=reward, args=config, train_dataset=train,
                              processing_class=tokenizer, callbacks=[validation])
    trainer.train()
    end = validation.val[-1]["wall_s"]
    steps = trainer.state.global_step
    result = {
        "t0": validation.t0,
        "train_wall_s": end - validation.t0,
        "eval_s": validation.eval_s,
        "steps": steps,
        "samples": steps * config.per_device_train_batch_size * config.gradient_accumulation_steps,
        "val": validation.val,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
    }
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
