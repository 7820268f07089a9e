"""Config schemas at eagleray's boundaries (YAML files and HTTP/user_config payloads).

Every model forbids unknown fields and describes every field; errors name the dotted field
(see :func:`eagleray.platform.config.parse_config`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from eagleray.platform.config.load import StrictModel

RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
KILL_MARKER = ".test-worker-killed"


def check_custom_resources(field: str, resources: dict[str, float], instead: str) -> None:
    """Custom Ray resources only: CPU/GPU/memory have their own fields; amounts must be > 0."""
    reserved = sorted(set(resources) & set(RESERVED_RESOURCES))
    if reserved:
        raise ValueError(
            f"{field}: {reserved} are not custom resources ({instead}); {field} takes only resources "
            f"given to nodes with `ray start --resources`"
        )
    bad = {k: v for k, v in resources.items() if not v > 0 or not k}
    if bad:
        raise ValueError(f"{field}: every amount must be > 0 and every name non-empty (got {bad})")


class FaultHooks(StrictModel):
    """Base of a config's ``testing`` section: fault-injection hooks used by eagleray's own tests, all off by default
    (each a :func:`testing_kill` or :func:`testing_delay` field). :meth:`kill_once` is what a kill hook does."""

    @staticmethod
    def kill_once(output_dir: str, note: str) -> None:
        """SIGKILL this process, unless a kill hook already fired for ``output_dir``: the marker file it leaves there
        (:data:`KILL_MARKER`, ``note`` inside) keeps the kill to once, so the retried run gets through."""
        marker = Path(output_dir) / KILL_MARKER
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"pid {os.getpid()} killed itself {note}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def testing_hooks(hooks: type[FaultHooks]) -> Any:
    """The ``testing`` field of a config: its fault-injection hooks (``hooks``, all off by default)."""
    return Field(default_factory=hooks, description="Fault-injection hooks used by eagleray's own tests; leave unset.")


def testing_kill(ge: int, who: str, after: str, proves: str) -> Any:
    """A hook that SIGKILLs a process once, at a count (None: never); a marker file in output_dir keeps it to once."""
    return Field(
        None,
        ge=ge,
        description=f"Testing only: {who} SIGKILLs itself once (marker file in output_dir) {after}, to prove {proves}.",
    )


def testing_delay(description: str) -> Any:
    """A hook that slows a stage down by a sleep of this many seconds (0: none)."""
    return Field(0.0, ge=0.0, description=f"Testing only: {description}")


class DatagenTesting(FaultHooks):
    kill_extract_worker_after_shards: int | None = testing_kill(
        0, "the hidden-state worker", "after writing this many shards, mid-write", "a killed worker loses nothing"
    )
    chunk_delay_s: float = testing_delay(
        "sleep this long per shard in the hidden-state stage (slows a run so a test can kill the driver mid-run)."
    )


class TrainTesting(FaultHooks):
    kill_worker_at_step: int | None = testing_kill(
        1, "rank 0", "after this optimizer step", "a run resumes from its last checkpoint"
    )
    step_delay_s: float = testing_delay(
        "sleep this long after each optimizer step (slows a run so a test can kill a node mid-run)."
    )


class TargetConfig(StrictModel):
    model: str = Field(
        "smollm2", description="Target model: a Hugging Face directory, or 'smollm2' for the packaged SmolLM2-135M-Instruct."
    )
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Weight/activation dtype. fp32 on CPU for exact comparisons.")
    tensor_parallel_size: int = Field(1, ge=1, description="Number of tensor-parallel ranks (one process per GPU; gloo on CPU).")
    max_model_len: int | None = Field(
        None, ge=16, description="Context length served; default the target's max_position_embeddings."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs; auto picks cuda when available.")


class TreeConfig(StrictModel):
    depth: int = Field(5, ge=1, le=16, description="Draft steps per tree (longest path).")
    topk: int = Field(4, ge=1, le=16, description="Children expanded per node.")
    num_draft_tokens: int = Field(8, ge=1, le=128, description="Total tree nodes verified per step (excluding the root).")

    @model_validator(mode="after")
    def _enough_nodes(self) -> "TreeConfig":
        if self.num_draft_tokens < self.depth:
            raise ValueError(f"num_draft_tokens ({self.num_draft_tokens}) must be >= depth ({self.depth}) to reach full depth")
        return self


class PolicyConfig(StrictModel):
    watchdog_window: int = Field(64, ge=4, description="Verification steps over which the acceptance watchdog averages τ.")
    watchdog_min_tau: float = Field(1.05, ge=1.0, description="The watchdog fires when mean τ over the window stays below this.")
    on_low_acceptance: Literal["warn", "disable", "rollback"] = Field(
        "warn", description="What the watchdog does: log+metric only, turn speculation off, or roll back to the previous draft."
    )
    adaptive: bool = Field(
        True,
        description="Lower k or turn speculation off when it is measured slower than plain decoding; turn it back on when it pays.",
    )


class DraftConfig(StrictModel):
    source: str = Field(
        description="Draft checkpoint: a directory, 'models:/<name>@<alias>' (MLflow registry), or 'random' (untrained, for checks)."
    )
    algorithm: Literal["eagle3", "eagle"] | None = Field(
        None, description="Speculative algorithm; derived from the draft when unset, refused when it disagrees."
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Chain length k drafted per step (chain mode).")
    tree: TreeConfig | None = Field(None, description="Draft an EAGLE top-k tree instead of a chain.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Acceptance watchdog and adaptive speculation.")


class MlflowConfig(StrictModel):
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default sqlite under $EAGLERAY_HOME/mlflow.")
    experiment: str = Field("eagleray", description="Experiment name for runs.")
    registered_model: str = Field("eagleray-draft", description="Registered model name for drafts.")


class GenerationConfig(StrictModel):
    max_tokens: int = Field(256, ge=1, description="Maximum response tokens per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(0, description="Base seed; each prompt derives its own from its id.")


class DatagenConfig(StrictModel):
    prompts: list[str] = Field(
        description="Prompt sources: 'sharegpt', 'mtbench', 'humaneval', or JSONL/Parquet paths (messages/conversations/prompt)."
    )
    output_dir: str = Field(
        description="Where Parquet shards, the manifest and the errors table are written (a filesystem every Ray worker can reach)."
    )
    target: TargetConfig = Field(
        default_factory=TargetConfig, description="Target that regenerates responses and gives hidden states."
    )
    limit: int | None = Field(None, ge=1, description="Use at most this many prompts (after turn splitting, dedup and hold-out).")
    shuffle_seed: int | None = Field(None, description="Shuffle prompts with this seed before the limit.")
    split_turns: bool = Field(
        True, description="One prompt per assistant turn of a multi-turn conversation (platform.prompts.prompt_turns)."
    )
    answer_turns: Literal["last", "all"] = Field(
        "last",
        description="'last': answer each prompt's last user turn (with split_turns every turn is a prompt, on the dataset's earlier answers); 'all': answer every user turn of a conversation in order, each on the target's OWN earlier answers (EAGLE-3/SpecForge multi-turn regeneration; `eagleray regenerate` with backend eagleray and split_turns: false).",
    )
    backend: Literal["eagleray", "vllm", "transformers", "given"] = Field(
        "eagleray",
        description="Regeneration backend: eagleray's engine, vLLM through ray.data.llm, transformers generate, or 'given': each record's last message (role assistant) is already the target's answer, e.g. from `eagleray regenerate`, so only hidden states are computed (needs split_turns: false).",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Sampling settings for regeneration.")
    draft: DraftConfig | None = Field(
        None,
        description="backend 'eagleray' only: an EAGLE-3 draft to decode speculatively (a directory or 'random'); greedy responses are unchanged.",
    )
    aux_layer_ids: list[int] | None = Field(None, description="Target layers to capture; default EAGLE-3's (2, N//2, N-3).")
    max_seq_len: int = Field(
        2048, ge=16, description="Prompt + response tokens kept per row; longer rows are truncated (column 'truncated')."
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Prompts longer than this are recorded as errors (prompt_too_long); default max_seq_len - generation.max_tokens.",
    )
    rows_per_shard: int = Field(256, ge=1, description="Prompts per Parquet shard (one shard = one unit of work and of resume).")
    num_workers: int = Field(1, ge=1, description="Actor-pool size of each model stage (regeneration and hidden states).")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per model-stage actor.")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs reserved per model-stage actor (0 on CPU).")
    prefer_resource: str | None = Field(
        None,
        min_length=1,
        description="Place the model-stage actors on the first alive node that has this custom Ray resource (`ray start --resources`), softly: when that node dies or is full, Ray places them on any other node and Ray Data redoes the lost chunks there.",
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="Prompts per generate() call in the regeneration stage (answer_turns 'all': conversations in flight).",
    )
    kv_cache_gib: float = Field(1.0, gt=0.0, description="backend 'eagleray': memory of the engine's KV cache.")
    forward_tokens: int = Field(8192, ge=16, description="Token budget of one packed target forward in the hidden-state stage.")
    hold_out_eval: bool = Field(
        True, description="Drop prompts whose id or normalised user text occurs in MT-bench or HumanEval."
    )
    retry_failed: bool = Field(
        False, description="On a rerun, retry prompts recorded in the errors table instead of skipping them."
    )
    progress_seconds: float = Field(30.0, gt=0.0, description="Print a progress line (rows/s, tokens/s, ETA) this often.")
    est_tokens_per_second: float | None = Field(
        None,
        gt=0.0,
        description="Generated tokens/s per worker used for the time estimate; default a rough guess from model size and device.",
    )
    disk_headroom: float = Field(
        1.2, ge=1.0, description="Refuse to start unless free space >= estimated output size x this factor."
    )
    ray_address: str | None = Field(None, description="Ray cluster address; default RAY_ADDRESS or a local instance.")
    testing: DatagenTesting = testing_hooks(DatagenTesting)

    @property
    def prompt_token_cap(self) -> int:
        """Longest prompt regenerated: max_prompt_tokens, else max_seq_len - generation.max_tokens."""
        return self.max_prompt_tokens or max(1, self.max_seq_len - self.generation.max_tokens)

    def prompt_too_long(self, n: int) -> str | None:
        """The prompt_too_long error message for a prompt of ``n`` tokens, or None when it fits."""
        cap = self.prompt_token_cap
        return f"prompt has {n} tokens > max_prompt_tokens {cap}" if n > cap else None

    @model_validator(mode="after")
    def _given_keeps_conversations_whole(self) -> "DatagenConfig":
        if self.backend == "given" and self.split_turns:
            raise ValueError(
                "backend is 'given' (the last assistant message of each record is the answer) but split_turns is true, "
                "which would cut the answers off; set split_turns: false"
            )
        if self.answer_turns == "all" and (self.split_turns or self.backend != "eagleray"):
            raise ValueError(
                "answer_turns is 'all' (every user turn answered on the target's own history) but "
                f"split_turns is {self.split_turns} and backend is {self.backend!r}; set split_turns: false and backend: eagleray"
            )
        if self.backend == "given" and self.draft is not None:
            raise ValueError("backend is 'given' (nothing is generated) but draft is set; remove draft")
        return self


class OnlineDataConfig(StrictModel):
    prompts: list[str] = Field(
        description="Conversations whose LAST message is the assistant response to learn (JSONL/Parquet/JSON paths, 'sharegpt'); the target computes hidden states per batch."
    )
    limit: int | None = Field(None, ge=1, description="Use at most this many conversations from each source.")
    vocab_count_rows: int = Field(
        2000, ge=1, description="Conversations tokenized up front to count tokens for the draft vocabulary."
    )
    loss_turns: Literal["last", "all"] = Field(
        "last",
        description="Which assistant messages are learned: 'last' (the regenerated answer; earlier ones may be the dataset's), or 'all' (every assistant message: conversations regenerated turn by turn, `answer_turns: all`).",
    )


class ReplayConfig(StrictModel):
    data_dir: str = Field(
        description="A datagen output (the original training data) mixed into the rows trained on, so fine-tuning on new data does not forget it."
    )
    fraction: float = Field(
        0.3, ge=0.0, lt=1.0, description="Share of training rows drawn from replay.data_dir (the rest from data_dir)."
    )


class TrainingConfig(StrictModel):
    data_dir: str = Field(
        description="Datagen output directory (shards + manifest.json + vocab_counts.npy), or 'online' (see `online`)."
    )
    online: OnlineDataConfig | None = Field(None, description="Online data: required when data_dir is 'online'.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="Target the draft is for.")
    output_dir: str = Field(
        description="Where checkpoints and the final draft are written (Ray Train storage under output_dir/ray)."
    )
    init_from: str | None = Field(
        None,
        description="Start from this draft (directory or models:/name@alias) instead of a fresh one; its vocab and aux layers are kept.",
    )
    aux_layer_ids: list[int] | None = Field(
        None, description="Target layers the draft reads; default the dataset's (offline) or EAGLE-3's (2, N//2, N-3) (online)."
    )
    replay: ReplayConfig | None = Field(
        None,
        description="Offline only: mix rows of another dataset (e.g. the champion's original data) into training; continual fine-tuning on captured traffic uses it with init_from.",
    )
    run_tags: dict[str, str] = Field(
        default_factory=dict,
        description="Extra tags of the MLflow run (the adaptation loop records its traffic window and decision id here).",
    )
    draft_vocab_size: int = Field(
        32000, ge=1, description="Draft vocabulary size (capped at the target's vocab), the most frequent loss-masked tokens."
    )
    init_lm_head_from_target: bool = Field(
        True, description="Initialise the draft lm_head from the target's lm_head rows of the draft vocab."
    )
    ttt_steps: int = Field(7, ge=1, le=16, description="Unrolled training-time-test steps.")
    loss_decay: float = Field(0.8, gt=0.0, le=1.0, description="Weight of step i is loss_decay**i.")
    learning_rate: float = Field(5e-5, gt=0.0, description="AdamW peak learning rate (betas 0.9, 0.95).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps before cosine decay.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine decays to learning_rate x this at max_steps.")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps (with max_minutes: the most it may take).")
    max_minutes: float | None = Field(
        None,
        gt=0.0,
        description="Wall-clock budget of the training loop (minutes, from its first step): the schedule's length is re-fitted at every log point from the measured step time so the cosine ends when the budget does; training stops there (final checkpoint and eval as at max_steps). None: max_steps alone decides.",
    )
    batch_size: int = Field(8, ge=1, description="Sequences per step per worker.")
    max_seq_len: int = Field(2048, ge=16, description="Sequences are truncated to this many tokens.")
    shuffle_buffer: int = Field(256, ge=1, description="Rows shuffled (and grouped by length) together.")
    grad_clip: float = Field(0.5, gt=0.0, description="Gradient norm clip.")
    autocast: Literal["auto", "bf16", "off"] = Field("auto", description="bf16 autocast: auto = on for CUDA, off on CPU.")
    seed: int = Field(0, description="Seed of the draft init and data order.")
    max_shards: int | None = Field(
        None,
        ge=1,
        description="Offline only: train on the first N shards by name (names are content hashes: a fixed pseudo-random subset) for data-size studies; the draft vocabulary and dataset id then come from those shards.",
    )
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of prompt ids held out for evaluation (simulated τ).")
    eval_batches: int | None = Field(50, ge=1, description="At most this many held-out batches are evaluated.")
    checkpoint_every: int = Field(100, ge=1, description="Save a resumable checkpoint every N steps (and at the end).")
    log_every: int = Field(10, ge=1, description="Log metrics to MLflow every N steps (rank 0).")
    backend: Literal["ray", "local"] = Field(
        "ray", description="Ray Train TorchTrainer (DDP over num_workers), or one in-process worker (debugging, tests)."
    )
    num_workers: int = Field(1, ge=1, description="Ray Train workers (DDP).")
    use_gpu: bool = Field(False, description="Train on GPUs (one per worker).")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per Ray Train worker.")
    max_failures: int = Field(1, ge=0, description="Worker-group restarts (from the latest checkpoint) before the run fails.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker needs besides cpus_per_worker/use_gpu, e.g. {'trainer': 1} for nodes started with `ray start --resources '{\"trainer\": 1}'`: places the workers on those nodes.",
    )
    after_node_loss: Literal["wait", "anywhere"] = Field(
        "wait",
        description="With resources_per_worker, when a worker (or its node) is lost: 'wait' restarts from the last checkpoint with the same resources, so the run waits until a node that has them (a replacement) joins; 'anywhere' restarts from the last checkpoint without resources_per_worker, on the nodes that are left. Each restart counts against max_failures.",
    )
    ray_address: str | None = Field(None, description="Ray cluster address; default RAY_ADDRESS or a local instance.")
    register_model: bool = Field(True, description="Register the final draft as a model version in the MLflow registry.")
    alias: str | None = Field("candidate", description="Alias set on the registered version (promotion later moves 'champion').")
    evaluate_with_engine: bool = Field(
        False,
        description="After training, jobs/train.py measures real τ and speed with eagleray's engine (serve.measure.measure_draft) and logs them to the same MLflow run.",
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="Tracking and registry.")
    testing: TrainTesting = testing_hooks(TrainTesting)

    @model_validator(mode="after")
    def _online_needs_prompts(self) -> "TrainingConfig":
        check_custom_resources("resources_per_worker", self.resources_per_worker, "set cpus_per_worker / use_gpu")
        if self.resources_per_worker and self.backend != "ray":
            raise ValueError(
                "resources_per_worker places Ray Train workers but backend is 'local'; set backend: ray or remove resources_per_worker"
            )
        if self.data_dir == "online" and self.online is None:
            raise ValueError(
                "data_dir is 'online' but `online` is not set; add online.prompts (conversations ending with the assistant answer)"
            )
        if self.data_dir == "online" and self.replay is not None:
            raise ValueError("replay mixes offline shards but data_dir is 'online'; point data_dir at a datagen output")
        if self.data_dir == "online" and self.max_shards is not None:
            raise ValueError("max_shards selects offline shards but data_dir is 'online'; use online.limit to train on less data")
        return self
