"""What a valid config is: every number in its declared range, the rules of one key, then the
rules that relate keys; :class:`ConfigError` names every key involved."""

from __future__ import annotations

import ipaddress
import re

from async_rl.algos.options import LOSSES, algorithm_problems, estimator_info, loss_info
from async_rl.bounds import bound_problems
from async_rl.config.sections import LOOPBACK_NAMES, LORA_KEY, MIN_API_KEY_LENGTH, MODEL_NAME_PATTERN, OPENAI_API_KEY_ENV, Config, JudgeConfig


class ConfigError(ValueError):
    """A configuration problem; the message says which key and how to fix it."""


def validate(cfg: Config) -> None:
    """Check every numeric key against the range declared on its field (:mod:`async_rl.bounds`),
    the few other one-key rules, then the cross-field rules; raise ConfigError naming every
    key involved. The cross-field rules are checked once every key is in its range (they
    assume it: a divisor >= 1)."""
    problems = bound_problems(cfg) + _key_problems(cfg)
    if not problems:
        problems = _cross_field_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _key_problems(cfg: Config) -> list[str]:
    """The rules of one key that are not a numeric range."""
    problems = [] if cfg.rollout.openai_host else ["rollout.openai_host must not be empty (0.0.0.0 binds every interface)"]
    key = cfg.rollout.openai_api_key
    if key is not None and (len(key) < MIN_API_KEY_LENGTH or not all("!" <= c <= "~" for c in key)):
        # The message never quotes the key: it may be a real one with a typo.
        problems.append(f"rollout.openai_api_key (or {OPENAI_API_KEY_ENV}) must be at least {MIN_API_KEY_LENGTH} visible ASCII "
                        "characters, no spaces (e.g. the output of `openssl rand -hex 32`); null for no key")
    for name, optim in (("learner.optim", cfg.learner.optim), ("learner.critic.optim", cfg.learner.critic.optim)):
        if len(optim.betas) != 2:
            problems.append(f"{name}.betas={optim.betas} must be two numbers")
    if cfg.learner.lora is not None:
        problems += cfg.learner.lora.problems()
    for name, model in cfg.models.items():
        if not re.fullmatch(MODEL_NAME_PATTERN, name):
            problems.append(f"models.{name}: a served model's name must match {MODEL_NAME_PATTERN} (lower case, digits, _; "
                            "it names its servers and metrics), e.g. models.judge")
        problems += model.problems(name)
    return problems + algorithm_problems(cfg.algorithm.advantage.name, cfg.algorithm.loss.name)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only: ``localhost`` or a loopback address
    (``127.0.0.0/8``, ``::1``); ``0.0.0.0`` and every other name or address is not."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cross_field_problems(cfg: Config) -> list[str]:
    """The rules that relate two or more keys, each message naming all of them."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    r, lrn, alg, loss = cfg.rollout, cfg.learner, cfg.algorithm, cfg.algorithm.loss
    need(
        r.openai_port == 0 or r.openai_port <= 65536 - r.num_servers,
        f"rollout.openai_port={r.openai_port} must be 0 (free ports) or in [1, {65536 - r.num_servers}] "
        f"(server i uses port + i, rollout.num_servers={r.num_servers})",
    )
    need(
        not r.openai_api or r.openai_api_key is not None or is_loopback(r.openai_host),
        f"rollout.openai_host={r.openai_host!r} is not loopback: the OpenAI-compatible API would answer anyone who reaches it. "
        f"Set a key (rollout.openai_api_key, or better the environment variable {OPENAI_API_KEY_ENV}), "
        "or keep rollout.openai_host=127.0.0.1 (or rollout.openai_api=false)",
    )
    need(lrn.batch_size % lrn.critic.ppo_mini_batches == 0,
         f"learner.critic.ppo_mini_batches={lrn.critic.ppo_mini_batches} must divide learner.batch_size={lrn.batch_size}")
    kc = alg.kl_ctrl
    need(kc.type != "adaptive" or kc.kl_coef > 0, f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be > 0 with algorithm.kl_ctrl.type='adaptive' (it only scales)")
    need(not alg.use_advantage_shaping or alg.use_vppo_on_perception,
         "algorithm.use_advantage_shaping=true needs algorithm.use_vppo_on_perception=true (the shaping scales by the visual dependency it computes)")
    need(r.reward.num_workers <= r.reward.max_workers,
         f"rollout.reward.num_workers={r.reward.num_workers} must be <= rollout.reward.max_workers={r.reward.max_workers}")
    need(cfg.data.max_pixels >= cfg.data.min_pixels,
         f"data.max_pixels={cfg.data.max_pixels} must be >= data.min_pixels={cfg.data.min_pixels}")
    need(
        not estimator_info(alg.advantage.name).group or r.n > 1,
        f"algorithm.advantage.name={alg.advantage.name!r} compares samples of the same prompt and needs rollout.n > 1 (got rollout.n={r.n})",
    )
    need(
        lrn.batch_size % lrn.ppo_mini_batches == 0,
        f"learner.batch_size={lrn.batch_size} must be divisible by learner.ppo_mini_batches={lrn.ppo_mini_batches}",
    )
    need(
        cfg.queue.max_depth >= lrn.batch_size,
        f"queue.max_depth={cfg.queue.max_depth} must be >= learner.batch_size={lrn.batch_size}, or producers block before a batch can form",
    )
    window = (alg.max_staleness + 1) * lrn.batch_size
    need(
        not lrn.fill_staleness_window or cfg.queue.max_depth >= window,
        f"learner.fill_staleness_window=true needs queue.max_depth={cfg.queue.max_depth} >= (algorithm.max_staleness + 1) x "
        f"learner.batch_size = {window}: producers would block before the window fills and the learner would wait for it forever",
    )
    need(
        lrn.max_tokens_per_microbatch >= cfg.max_sample_tokens,
        f"learner.max_tokens_per_microbatch={lrn.max_tokens_per_microbatch} must hold one whole sample: "
        f">= data.max_prompt_length + rollout.max_response_length = {cfg.max_sample_tokens}",
    )
    if r.vllm.max_model_len is not None:
        need(
            r.vllm.max_model_len >= cfg.max_sample_tokens,
            f"rollout.vllm.max_model_len={r.vllm.max_model_len} must be >= data.max_prompt_length + rollout.max_response_length "
            f"= {cfg.max_sample_tokens}",
        )
    bypass = ", ".join(repr(name) for name, info in LOSSES.items() if info.bypass)
    need(
        alg.recompute_proximal or not loss_info(loss.name).behaviour_weight,
        f"algorithm.loss.name={loss.name!r} needs algorithm.recompute_proximal=true (with false, pi_prox = mu and the loss is {bypass})",
    )
    if (judge := r.reward.judge) is not None:
        need(judge.model in cfg.models, f"rollout.reward.judge.model={judge.model!r} must name a served model "
                                        f"(models: {', '.join(cfg.models) or 'none'}): add models.{judge.model or 'judge'}.model_path=...")
        need(r.env.name is None, f"rollout.reward.judge scores single responses; rollout.env.name={r.env.name!r} scores episodes itself: "
                                 "set one of them to null")
        need(r.reward.weight > 0 or judge.weight > 0, "rollout.reward.weight and rollout.reward.judge.weight are both 0: the reward would always be 0")
        if judge.model in cfg.models and cfg.models[judge.model].task == "classify":
            default = JudgeConfig.function
            need(judge.function == default and not judge.kwargs,
                 f"rollout.reward.judge.model={judge.model!r} is a reward model (task: classify): its probability is the score, which no "
                 f"function reads; remove rollout.reward.judge.function={judge.function!r} and its kwargs (or serve a model that answers, task: generate)")
    if (distill := alg.distill) is not None:
        need(distill.teacher in cfg.models, f"algorithm.distill.teacher={distill.teacher!r} must name a served model "
                                            f"(models: {', '.join(cfg.models) or 'none'}): add models.{distill.teacher or 'teacher'}.model_path=...")
        need(distill.teacher not in cfg.models or cfg.models[distill.teacher].task == "generate",
             f"algorithm.distill.teacher={distill.teacher!r} is a reward model (task: classify), which has no log-probs of tokens: "
             f"distil from a language model (models.{distill.teacher}.task: generate)")
        need(r.env.name is None, f"algorithm.distill scores single responses; rollout.env.name={r.env.name!r} runs episodes: set one of them to null")
        need(r.temperature == 1.0, f"algorithm.distill compares the teacher's log-probs with the sampler's, which rollout.temperature="
                                   f"{r.temperature:g} rescales: sample at rollout.temperature=1.0")
    if lrn.lora is not None:
        for key, on in (("algorithm.use_vppo_on_perception", alg.use_vppo_on_perception), ("learner.freeze_vision_tower", lrn.freeze_vision_tower)):
            need(not on, f"{key}=true is for vision-language models, which {LORA_KEY} does not support yet: set {key}=false, "
                         f"or train without {LORA_KEY} (null)")
    return problems
