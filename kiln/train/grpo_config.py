"""The [grpo] table: its keys, their TRL 1.16 defaults where TRL has the key, and their checks (kiln.train.recipes.grpo
runs it)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kiln.train.config import Section
from kiln.train.grpo_loss import LossSpec


class GRPOSection(Section):
    """RL with verifiable rewards (present = on); defaults are TRL 1.16's GRPOConfig's where it has the key."""
    model_config = ConfigDict(populate_by_name=True)  # agent3: `async` (a Python keyword) is the field async_
    rewards: list[str] = []             # "module:function" (beside the prompts file, or on sys.path) or a built-in
    reward_weights: list[float] | None = None
    format_pattern: str | None = None   # the `format` built-in's regular expression (whole completion)
    prompt_field: str = "prompt"
    num_generations: int = 8            # completions per prompt (a group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    min_p: float = 0.0                  # keep tokens with probability >= min_p x the highest (0: off; TRL's None)
    repetition_penalty: float = 1.0     # HF's, over prompt + completion tokens (1: off)
    rollout: Literal["engine", "generate"] = "engine"  # kiln.engine ("generate", the earlier loop: removed)  # engfsdp
    # engine rollouts: the trainer's log-probs through the engine's kernels, the sampler's bits (logprob_gap 0);
    # off by default: that scoring makes the update ~6x the training forward's (benchmarks/bench_grpo.py: 25.7 s
    # against 4.2 s a step; 2.6x single-threaded) and holds more memory, to remove a gap of fp32 rounding (~1e-6)
    exact_logprobs: bool = False
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # rloo: TRL's RLOOTrainer loss (sequence ratio; with advantage_estimator = "rloo", beta = 0)
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "rloo"] = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"   # "sequence": GSPO
    epsilon: float = 0.2
    epsilon_high: float | None = None   # default: epsilon (cispo: the cap on the weight, TRL's meaning)
    delta: float | None = None          # two-sided clipping: the weight capped at delta (A < 0 too)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's sequence mask (A < 0 and mean KL over it)
    use_bias_correction_kl: bool = False  # TRL 1.16 defaults to true; false keeps kiln's earlier runs as they were
    mask_truncated_completions: bool = False  # completions without an end token carry no loss
    advantage_estimator: Literal["grpo", "rloo"] = "grpo"  # rloo: leave-one-out baseline (TRL's RLOOTrainer)
    normalize_advantages: bool = False  # rloo: advantages standardised over the batch (RLOOConfig's key)
    # the old log-probs (sampler = "exact": the trainer's) against the sampler's: TRL's vllm_importance_sampling_*
    importance_sampling_correction: bool = False
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        "sequence_mask"
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0
    num_iterations: int = 1             # optimizer steps per rollout
    beta: float = 0.0                   # KL to the starting weights (0: no reference pass)
    sampler: Literal["fast", "exact"] = "fast"  # old log-probs from the decode, or recomputed by the trainer
    # multi-turn episodes (kiln.train.envs, kiln.train.agent_rollout): max_new_tokens is then the per-turn budget
    env: str | None = None              # "module:factory", called once per episode
    tools: list[str] = []               # "module:function" stateless tools (typed, with docstrings)
    max_turns: int = 4                  # policy turns per episode
    max_episode_tokens: int = 1024      # every token after the prompt (policy and environment)
    env_timeout: float = 30.0           # seconds for each call into an environment or a tool
    reward_timeout: float = 60.0        # seconds for each call of a user's reward function (then: None rewards)
    reward_max_failures: int = 3        # failing calls (raised / timed out) of one reward function in a row: stop
    log_rollouts_every: int = 0         # every N rollouts, RUN_DIR/rollouts.jsonl gets each completion (0: off)
    # agent3: off-policy steps (kiln.train.grpo_async): the next rollouts sampled by a background worker from a
    # copy of the weights while this one trains, each at most max_staleness optimizer steps behind
    async_: bool = Field(False, alias="async")
    max_staleness: int = 1              # TRL's AsyncGRPOConfig key (its default 4: it drops staler samples)

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_scale(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check(self) -> GRPOSection:
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be >= 2, got {self.num_generations}: advantages compare "
                             "the completions of one prompt with each other, and a group of 1 has nothing to compare")
        for name in ("max_new_tokens", "num_iterations", "max_turns", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"grpo.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"grpo.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"grpo.min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"grpo.repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.rollout == "generate":  # engfsdp
            raise ValueError("grpo.rollout = \"generate\" is no more: kiln's earlier generation loop was removed "
                             "(issue 39); rollouts run on the generation engine (\"engine\", the default; "
                             "benchmarks/old_loop.py keeps a copy of the loop as a measured baseline)")
        if self.top_k < 0 or self.epsilon < 0 or (self.epsilon_high or 0) < 0 or self.beta < 0:
            raise ValueError("grpo.top_k, epsilon, epsilon_high and beta must be >= 0")
        if not (math.isfinite(self.reward_timeout) and self.reward_timeout > 0):
            raise ValueError(f"grpo.reward_timeout must be a finite number of seconds > 0, got {self.reward_timeout}")
        if self.reward_max_failures < 1:
            raise ValueError(f"grpo.reward_max_failures must be >= 1, got {self.reward_max_failures}")
        if not self.env_timeout > 0:
            raise ValueError(f"grpo.env_timeout must be > 0 seconds, got {self.env_timeout}")
        if self.log_rollouts_every < 0:
            raise ValueError(f"grpo.log_rollouts_every must be >= 0, got {self.log_rollouts_every}")
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"grpo.importance_sampling_clip_min ({lo}) must be below "
                             f"grpo.importance_sampling_clip_max ({hi})")
        if self.max_staleness < 0:  # agent3
            raise ValueError(f"grpo.max_staleness must be >= 0, got {self.max_staleness}")
        if self.async_ and not self.importance_sampling_correction:  # agent3
            raise ValueError("grpo.async = true trains on rollouts sampled up to grpo.max_staleness optimizer steps "
                             "ago: set grpo.importance_sampling_correction = true (the correction against the "
                             "rollout's log-probs; importance_sampling_mode and _clip_min / _clip_max choose "
                             "truncated or masked IS)")
        if self.importance_sampling_correction:
            if self.sampler != "exact" and not self.async_:  # agent3: async recomputes the old log-probs
                raise ValueError("grpo.importance_sampling_correction corrects the trainer's old log-probs towards "
                                 "the sampler's, and with grpo.sampler = \"fast\" they are the sampler's (nothing to "
                                 "correct): set grpo.sampler = \"exact\" or turn the correction off")
            if self.importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
                raise ValueError(f"grpo.importance_sampling_mode = {self.importance_sampling_mode!r} truncates the "
                                 "ratio: set grpo.importance_sampling_clip_max and/or importance_sampling_clip_min")
            if self.loss_type == "vespo" and not self.importance_sampling_mode.startswith("token"):
                raise ValueError("grpo.loss_type = \"vespo\" takes a token-level correction: set "
                                 "grpo.importance_sampling_mode to \"token_truncate\" or \"token_mask\"")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold <= 0:
            raise ValueError(f"grpo.off_policy_mask_threshold must be > 0, got {self.off_policy_mask_threshold}")
        if self.delta is not None and self.delta <= 1:
            raise ValueError(f"grpo.delta caps the importance weight and must be > 1 (TRL recommends above "
                             f"1 + epsilon_high), got {self.delta}")
        if self.loss_type == "rloo":
            if self.advantage_estimator != "rloo":
                raise ValueError("grpo.loss_type = \"rloo\" is TRL's RLOOTrainer loss: set grpo.advantage_estimator "
                                 "= \"rloo\" as well (its leave-one-out advantages)")
            if self.beta != 0.0:
                raise ValueError("grpo.loss_type = \"rloo\" with grpo.beta: TRL's RLOO takes the KL as a penalty on "
                                 "the reward, which kiln does not compute yet; set grpo.beta = 0 (or another loss_type)")
            if self.importance_sampling_correction:
                raise ValueError("grpo.loss_type = \"rloo\" is TRL's RLOO loss, which has no importance-sampling "
                                 "correction: turn grpo.importance_sampling_correction off")
            if self.off_policy_mask_threshold is not None:
                raise ValueError("grpo.off_policy_mask_threshold is not part of TRL's RLOO loss: unset it with "
                                 "grpo.loss_type = \"rloo\"")
        if self.normalize_advantages and self.advantage_estimator != "rloo":
            raise ValueError("grpo.normalize_advantages is RLOO's option: set grpo.advantage_estimator = \"rloo\" "
                             "(the grpo estimator scales by grpo.scale_rewards)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} values for {len(self.rewards)} "
                             "grpo.rewards")
        return self

    @property
    def multi_turn(self) -> bool:
        return self.env is not None or bool(self.tools)

    @property
    def budget(self) -> int:
        """A completion's most tokens (dr_grpo's constant): the episode's under env / tools."""
        return self.max_episode_tokens if self.multi_turn else self.max_new_tokens

    def loss_spec(self) -> LossSpec:
        return LossSpec(self.loss_type, self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high,
                        self.importance_sampling_level, self.delta, self.beta, self.use_bias_correction_kl,
                        self.sapo_temperature_pos, self.sapo_temperature_neg, self.vespo_k_pos,
                        self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg, self.off_policy_mask_threshold)
