"""The ``async-rl`` command.

Exit codes: 0 success, 1 a failure while running, 2 a bad config or bad usage (with a
one-line reason on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from async_rl.config import ConfigError, load_config, reference_markdown, shareable

app = typer.Typer(
    help="async-rl: asynchronous RL post-training of language models (vLLM rollouts, Redis replay queue, FSDP2 learner).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect and document configurations.", no_args_is_help=True)
assets_app = typer.Typer(help="Build local assets (no network needed).", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(assets_app, name="assets")

out = Console()
err = Console(stderr=True)

ConfigArg = Annotated[Path, typer.Argument(help="YAML config file, e.g. configs/quickstart.yaml.")]
OverridesArg = Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, e.g. learner.optim.lr=1e-6.")]
# Quickstarts by task: (config, assets directory the config reads, tiny task to build there).
# Paths are relative: run from the repository root.
QUICKSTARTS = {
    "addition": (Path("configs/quickstart.yaml"), Path("runs/quickstart/assets"), "addition"),
    "multiturn": (Path("configs/multiturn_quickstart.yaml"), Path("runs/multiturn/assets"), "multiturn"),
    "vlm": (Path("configs/vlm_quickstart.yaml"), Path("runs/vlm/assets"), "vlm"),
    "running_sum": (Path("configs/running_sum_quickstart.yaml"), Path("runs/running_sum/assets"), "running_sum"),
    "judge": (Path("configs/judge_quickstart.yaml"), Path("runs/served/assets"), "served"),
    "distill": (Path("configs/distill_quickstart.yaml"), Path("runs/served/assets"), "served"),
}


def _load(config: Path | None, overrides: list[str] | None):
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def config_show(config: ConfigArg, overrides: OverridesArg = None) -> None:
    """Print the fully resolved config (defaults + file + overrides) as YAML, secrets shown as ***."""
    cfg = _load(config, overrides)
    sys.stdout.write(yaml.safe_dump(shareable(cfg), sort_keys=False, default_flow_style=False))


@config_app.command("docs")
def config_docs(
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Print the reference of every config key (type, default, meaning) as Markdown."""
    text = reference_markdown() + "\n"
    if out_file is None:
        sys.stdout.write(text)
    else:
        out_file.write_text(text)


@assets_app.command("tiny")
def assets_tiny(
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write model/, data/ and assets.json into.")],
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same tokenizer and weights.")] = 0,
    task: Annotated[str, typer.Option(help="addition (single-turn), multiturn (the addition_feedback environment's warm-start), running_sum (long written-out responses, a few minutes to build), vlm (an Idefics3 vision-language model and a coloured-square task) or served (the addition task with a distillation teacher and a judge beside it).")] = "addition",
) -> None:
    """Build the tiny tokenizer, Qwen2 model, arithmetic task and warm-start (about a minute on 2 cores); --task vlm: a tiny Idefics3 and a visual task (~15 s)."""
    from async_rl.tiny import TASKS, build_tiny_assets

    if task not in TASKS:
        typer.echo(f"error: --task {task!r} is not one of {', '.join(TASKS)}", err=True)
        raise typer.Exit(2)
    report = build_tiny_assets(out_dir, seed=seed, progress=lambda msg: err.print(msg, highlight=False, markup=False), task=task)
    out.print(f"tiny assets in {out_dir}: base greedy accuracy {report.base_accuracy:.1%}", highlight=False)


@assets_app.command("val-split")
def assets_val_split(
    assets: Annotated[Path, typer.Option("--assets", help="Directory of tiny addition assets (async-rl assets tiny).")],
    rows: Annotated[int, typer.Option(min=1, help="Validation rows (at most 5100: the task's 8100 problems less the 3000 of training).")] = 1500,
) -> None:
    """Write data/val_ROWS.jsonl into tiny addition assets: a larger validation split, disjoint from training, whose first 200 rows are val.jsonl (for benchmarks: 1500 rows give a standard error of about 1.3 points)."""
    from async_rl.tiny.text import write_validation_split

    try:
        path = write_validation_split(assets, rows)
    except (OSError, ValueError, KeyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    out.print(f"{rows} validation rows in {path}", highlight=False)


@app.command("eval")
def eval_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default: trainer.output_dir/eval).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Evaluate only the first N validation prompts.")] = None,
) -> None:
    """Greedy accuracy of learner.model_path on data.val_files, generated with vLLM."""
    cfg = _load(config, overrides)
    _run_eval(cfg, out_dir or Path(cfg.trainer.output_dir) / "eval", limit)


@app.command("train")
def train_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate config and resources, print the plan, start nothing.")] = False,
) -> None:
    """Train: Ray, Redis, inference servers, rollout workers and the FSDP2 learner, until trainer.total_steps."""
    cfg = _load(config, overrides)
    _train(cfg, dry_run)


@app.command("quickstart")
def quickstart(
    overrides: Annotated[
        Optional[list[str]], typer.Argument(help="[multiturn|vlm|running_sum|judge|distill] then dotted overrides, e.g. trainer.total_steps=50.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
) -> None:
    """Build the tiny assets if absent, then train configs/quickstart.yaml, or with
    `multiturn` first, configs/multiturn_quickstart.yaml, or with `vlm` first,
    configs/vlm_quickstart.yaml (a vision-language model with VPPO), or with `running_sum`
    first, configs/running_sum_quickstart.yaml (long responses), or with `judge` or `distill`
    first, configs/judge_quickstart.yaml (rewarded by a served judge) or
    configs/distill_quickstart.yaml (a served teacher) (CPU, about 10 minutes)."""
    from async_rl.tiny import build_tiny_assets

    args = list(overrides or [])
    name = args.pop(0) if args and "=" not in args[0] else "addition"
    if name not in QUICKSTARTS:
        typer.echo(f"error: no quickstart {name!r}; choose one of {', '.join(QUICKSTARTS)} (or give KEY=VALUE overrides)", err=True)
        raise typer.Exit(2)
    config, assets, task = QUICKSTARTS[name]
    if not (assets / "assets.json").is_file():
        build_tiny_assets(assets, seed=0, progress=lambda msg: err.print(msg, highlight=False, markup=False), task=task)
    _train(_load(config, args), dry_run)


def _train(cfg, dry_run: bool) -> None:
    if dry_run:  # the plan only: the driver's imports (torch, transformers, vLLM, Ray) cost seconds
        from async_rl.launch.plan import make_plan, render

        plan = make_plan(cfg)
        typer.echo(render(plan))
        raise typer.Exit(2 if plan.errors else 0)
    from async_rl.launch.plan import StartupError, startable_plan

    try:
        plan = startable_plan(cfg)  # a refused run, too, need not import the driver
    except StartupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    from async_rl.launch.driver import RunFailed, train
    from async_rl.queue import RedisNotInstalledError

    try:
        result = train(cfg, plan)
    except (StartupError, RunFailed, RedisNotInstalledError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if result.interrupted:
        typer.echo(f"interrupted at version {result.version}; final checkpoint in {result.run_dir}", err=True)
        raise typer.Exit(130)


def _run_eval(cfg, out_dir: Path, limit: int | None) -> None:
    from async_rl.rollout.offline_eval import evaluate

    for path, key in ((cfg.learner.model_path, "learner.model_path"), (cfg.data.val_files, "data.val_files")):
        if not Path(path).exists():
            typer.echo(f"error: {key}={path!r} does not exist (build the tiny assets with `async-rl assets tiny --out DIR`)", err=True)
            raise typer.Exit(2)
    result = evaluate(cfg, out_dir, limit=limit, progress=lambda msg: err.print(msg, highlight=False, markup=False))
    table = Table(title="examples")
    for col in ("prompt", "response", "answer", "reward"):
        table.add_column(col)
    for ex in result.examples:
        table.add_row(ex["prompt"], ex["response"], ex["answer"], ex["reward"])
    out.print(table)
    out.print(
        f"greedy accuracy {result.accuracy:.1%} on {result.prompts} prompts "
        f"({result.generated_tokens} tokens in {result.generate_s:.2f} s; engine start {result.engine_start_s:.1f} s; "
        f"{result.rejected_rows} malformed rows skipped) -> {out_dir / 'eval.json'}",
        highlight=False,
    )


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="Learner checkpoint directory, e.g. runs/x/checkpoints/step_00000010.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write the Hugging Face model into.")],
    critic: Annotated[bool, typer.Option("--critic", help="Export the run's critic (gae) instead of the policy.")] = False,
    merged: Annotated[bool, typer.Option("--merged", help="A LoRA checkpoint: write its base model with the adapter merged into "
                                         "the weights instead of the PEFT adapter directory (reads the base it was trained on).")] = False,
) -> None:
    """Write a learner checkpoint's policy (or critic) as a Hugging Face safetensors directory with tokenizer
    (the policy loads in transformers and vLLM; the critic as a one-label token classifier). A LoRA checkpoint's
    policy is written as a PEFT adapter directory (transformers + PEFT and vLLM load it onto its base), or merged."""
    from async_rl.learner.checkpoint import CheckpointMismatchError, export_hf

    try:
        export_hf(checkpoint, out_dir, critic=critic, merged=merged)
    except (FileNotFoundError, CheckpointMismatchError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    out.print(f"exported {checkpoint} -> {out_dir}", highlight=False)


@app.command("scale")
def scale_cmd(
    run_dir: Annotated[Path, typer.Argument(help="The running run's output_dir, e.g. runs/quickstart.")],
    servers: Annotated[int, typer.Option("--servers", min=1, help="Inference servers to run from now on.")],
    grace_s: Annotated[float, typer.Option("--grace-s", min=0.0, help="How long a leaving server's groups in flight may take to finish "
                                           "before their prompts go back to the queue, seconds.")] = 30.0,
    redis_url: Annotated[Optional[str], typer.Option("--redis-url", envvar="ASYNC_RL_REDIS_URL",
                                                     help="The run's Redis, when it is not the embedded one (its password is redacted in the run directory).")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Longest wait for the driver's answer, seconds.")] = 1800.0,
    model: Annotated[Optional[str], typer.Option("--model", help="Resize the servers of this served model (models.NAME) instead "
                                                 "of the policy's inference servers.")] = None,
) -> None:
    """Change the number of inference servers of a running run: new servers catch up to the current
    weights and produce; leaving ones drain (nothing lost or produced twice). With --model, the
    servers of a served model (a judge, a teacher) instead. The run's driver does it.
    Exit 0: done; 1: refused or failed; 3: the run ended before answering."""
    from async_rl.launch.scale import RunEndedError, ScaleError, request_scale

    try:
        reply = request_scale(run_dir, servers, grace_s, redis_url, timeout_s, progress=lambda line: err.print(line, highlight=False), model=model)
    except RunEndedError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(3) from None
    except ScaleError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for line in reply.lines:
        out.print(line, highlight=False)
    if not reply.ok:
        typer.echo(f"error: {reply.error}", err=True)
        raise typer.Exit(1)
    out.print(f"{reply.servers} {'servers of models.' + model if model else 'inference servers'}", highlight=False)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
