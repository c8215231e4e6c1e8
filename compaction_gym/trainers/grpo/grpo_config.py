"""``CompactionGRPOConfig``: :class:`trl.GRPOConfig` plus env, agent, compaction, replay and engine options."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from compaction_gym.agents.prompts import PROMPT_FORMATS
from compaction_gym.engine import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.devices import use_cpu_without_accelerator
from compaction_gym.trainers.replay import REPLAY_METHODS


@dataclass
class CompactionGRPOConfig(GRPOConfig):
    """:class:`trl.GRPOConfig` plus the environment, agent, compaction, replay and engine options.

    Sampling uses GRPOConfig's ``temperature``, ``top_p`` and ``top_k``; ``max_turn_tokens`` bounds
    each turn's response (``max_completion_length`` is not used: a completion is a whole episode).

    Example:
        >>> args = CompactionGRPOConfig("runs/grpo", env_id="AttnMatch-BabyAI-GoTo-v0",
        ...     compaction={"mode": "attention_matching", "max_kv_len": 2048, "compute_beta": True},
        ...     num_generations=8, per_device_train_batch_size=8, max_steps=100)  # doctest: +SKIP
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["env_kwargs", "compaction"]

    # -- environment ------------------------------------------------------------------------------
    env_id: str = field(
        default="AttnMatch-BabyAI-v0",
        metadata={
            "help": "Gymnasium id of the text env, or several ids separated by commas (rows cycle through "
            "them). Ignored when the trainer is given env factories."
        },
    )
    env_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments of gym.make, e.g. '{\"max_episode_steps\": 32}'."}
    )
    num_episodes: int = field(
        default=1024, metadata={"help": "Rows of the default episode dataset (one env seed per row)."}
    )
    episode_seed: int = field(default=0, metadata={"help": "First env seed of the default episode dataset."})
    # -- agent ------------------------------------------------------------------------------------
    prompt_format: str = field(
        default="balrog",
        metadata={"help": "How observations are framed.", "choices": sorted(PROMPT_FORMATS)},
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message."})
    max_turn_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tokens the agent may sample per turn (default: the prompt format's, e.g. 32 for balrog)."
        },
    )
    # -- compaction and replay --------------------------------------------------------------------
    compaction: dict | str | None = field(
        default=None,
        metadata={
            "help": 'The sessions\' CompactionConfig fields, e.g. \'{"mode": "attention_matching", '
            '"max_kv_len": 2048, "compute_beta": true}\' (None: no compaction).'
        },
    )
    grad_through_compaction: bool = field(
        default=True,
        metadata={
            "help": "Let gradients flow through the compacted blocks (C1 kept keys, C2 refitted values; β is a "
            "constant). False detaches them, as the seeds did."
        },
    )
    replay_method: str = field(
        default="auto",
        metadata={
            "help": "How replay rebuilds the compacted caches: one_pass (one forward over the whole episodes, "
            "each layer rebuilding its caches), segments (one forward per stretch between events) or auto "
            "(one_pass on an accelerator, segments on a CPU and for what one pass cannot replay)."
        },
    )
    replay_max_tokens_per_forward: int = field(
        default=2048,
        metadata={"help": "Longest run of tokens one episode feeds in one replay forward (segment replay)."},
    )
    replay_inference_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Episodes replayed together by the log-prob passes without gradient (reference model, old "
            "log-probs); None: TRL's chunk (per_device_train_batch_size). A segment replay runs one forward per "
            "segment between events, so replaying the whole generation batch at once (e.g. 32) runs a quarter "
            "of the forwards of 4 chunks of 8 (one pass: one forward either way); the results do not depend on it."
        },
    )
    replay_plan_cache: bool = field(
        default=True,
        metadata={
            "help": "Keep the one-pass replay plans of a generation batch for its later log-prob passes: each "
            "episode's simulation (host) and each chunk's device plan (index tensors on the GPU, tens of MB per "
            "chunk of 8 long episodes), dropped at the next rollout. False rebuilds them at every pass; the "
            "results do not depend on it."
        },
    )
    log_replay_mismatch: bool = field(
        default=True,
        metadata={
            "help": "Log replay/max_abs_logprob_diff, replay/mean_abs_logprob_diff and replay/mean_kl between the "
            "engine's sampling log-probs and the replay, whenever the policy still equals the sampler."
        },
    )
    # -- engine -----------------------------------------------------------------------------------
    engine_max_slots: int | None = field(
        default=None,
        metadata={"help": "Episodes played at once (default: the generation batch of one process)."},
    )
    engine_capacity: int | None = field(
        default=None, metadata={"help": "KV rows per session (default: 4096 on CPU, 8192 on GPU)."}
    )
    engine_fast: bool = field(
        default=False,
        metadata={
            "help": "Use the engine's CUDA fast path (fused kernels, CUDA graphs) for rollouts. It re-points the "
            "policy's q/k/v and gate/up parameters into packed matrices (shared storage); not with PEFT."
        },
    )
    engine_continuous: bool = field(
        default=True,
        metadata={
            "help": "Rollout episodes advance independently (continuous batching: an episode's next turn is "
            "submitted as soon as its env has stepped, not when the whole batch's replies are done). False: "
            "lock-step, one batched engine step per turn. Same trajectories either way."
        },
    )
    # -- defaults changed from GRPOConfig ---------------------------------------------------------
    # spelled as TrainingArguments spells it: HfArgumentParser special-cases this exact union
    report_to: None | str | list[str] = field(default="tensorboard", metadata={"help": "Trackers to log to."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Disable dropout so training forwards score what the sampler sampled."},
    )

    def __post_init__(self) -> None:
        use_cpu_without_accelerator(self)  # TRL's bf16=True default must build on CPU
        super().__post_init__()
        if self.prompt_format not in PROMPT_FORMATS:
            raise InvalidArgumentError(
                f"prompt_format must be one of {sorted(PROMPT_FORMATS)}, got {self.prompt_format!r}"
            )
        if self.compaction is None:
            self.compaction = {}
        if not isinstance(self.compaction, dict):
            raise InvalidArgumentError(
                f"compaction must be a dict of CompactionConfig fields, got {self.compaction!r}"
            )
        CompactionConfig.from_dict(self.compaction)  # raises with the valid field names
        if self.env_kwargs is not None and not isinstance(self.env_kwargs, dict):
            raise InvalidArgumentError(f"env_kwargs must be a dict, got {self.env_kwargs!r}")
        for name in ("max_turn_tokens", "engine_max_slots", "engine_capacity", "replay_inference_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1 or None, got {value}")
        if not isinstance(self.engine_continuous, bool):
            raise InvalidArgumentError(
                f"engine_continuous must be true or false, got {self.engine_continuous!r}"
            )
        if self.replay_method not in REPLAY_METHODS:
            raise InvalidArgumentError(
                f"replay_method must be one of {REPLAY_METHODS}, got {self.replay_method!r}"
            )
        for name in ("num_episodes", "replay_max_tokens_per_forward"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise InvalidArgumentError(
                "CompactionGRPOTrainer generates with the embedded engine (compacted sessions): set use_vllm=False "
                "and use_transformers_continuous_batching=False"
            )
        if (self.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            raise InvalidArgumentError(
                "gradient_checkpointing_kwargs use_reentrant=True would cut the gradient between replay segments "
                "(reentrant checkpoints only see positional inputs); use use_reentrant=False"
            )
        if self.min_p is not None:
            raise InvalidArgumentError("min_p is not supported by the engine's sampler; use top_p / top_k")

    @property
    def compaction_config(self) -> CompactionConfig:
        """The sessions' :class:`CompactionConfig`."""
        return CompactionConfig.from_dict(self.compaction or {})

    @property
    def sampling_params(self) -> SamplingParams:
        """The per-turn :class:`SamplingParams` (seeds are set per episode)."""
        max_new = self.max_turn_tokens or PROMPT_FORMATS[self.prompt_format].max_new_tokens
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0, max_new_tokens=max_new
        )
