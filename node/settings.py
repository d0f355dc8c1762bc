"""`diloco-node join`'s settings in typed sections: train, outer, merge, groups, network,
dashboard, checkpoint and logging. Each field's docstring is its flag's help; its type says
what a value may be (node/settings_types.py), and pydantic checks it (node/settings_cli.py
turns the sections into flags).

A field's flag is its name in kebab case (inner_steps -> --inner-steps), whatever its section.
Checks that span sections, and values resolved from the machine (--model auto), live in
`node.config.JoinConfig`, which has every section's fields.

A section builds the component config it stands for (`OuterSettings.outer_config`,
`MergeSettings.staleness_config`, `NetworkSettings.relay_limits`, ...); node/builders.py
takes the sections a part needs, by type, and composes those pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic.dataclasses import dataclass

from dht.grouping import GroupingConfig
from dht.reachability import RelayLimits
from merge.codec_names import AUTO, CODEC_NAMES
from merge.weighting import StalenessConfig, TokenWeightConfig
from node.presets import MODEL_NAMES
from node.settings_types import (
    FLAGS,
    LOG_LEVELS,
    STALENESS_KINDS,
    CorrectionStrength,
    DataSlice,
    GapWait,
    HeartbeatPeriod,
    Label,
    Megabytes,
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    OneOf,
    Port,
    PositiveFloat,
    PositiveInt,
    RunId,
    SpeedFactor,
    check,
    flag,
)

if TYPE_CHECKING:  # built by the methods below, which import them: the CLI loads without torch
    from merge.correction import CorrectionConfig
    from merge.group_update import ReductionConfig
    from merge.outer import OuterConfig

DILOCO_HOME = Path("~/.diloco")
DEFAULT_PORT = 31337
"""Where a node listens when --port is not given (and that port is free)."""
DEFAULT_IDENTITY = str(DILOCO_HOME / "identity.key")
"""The key a node uses when --identity is not given (and no other node here holds it)."""


@dataclass(kw_only=True, config=FLAGS)
class TrainSettings:
    """The model, the data and the inner loop: what this learner trains, and for how long."""

    run_id: RunId = "diloco-default"
    """Name of the run; nodes with the same run id, model and merge settings train together."""
    model: Annotated[str, OneOf(("auto", *MODEL_NAMES))] = "auto"
    """Model: tiny (~0.4M params), small (~10M params), base (~125M params), or a transformers
    architecture of that size, hf:ARCH-SIZE with ARCH llama or gpt2 (e.g. hf:llama-small);
    auto: tiny on a CPU, small on a GPU under 16 GiB, base above. The run's fingerprint holds
    the model auto picked, and the join command a node prints names it: a node whose auto
    picks another model is refused by the swarm with the --model to pass."""
    data: str | None = None
    """Text file, directory of text files or uint16 .bin; default: this Python's stdlib source."""
    data_slice: DataSlice = None
    """K/N: train only on the K-th of N equal contiguous slices of the training split, so nodes
    on different slices see different data (emulates non-IID learners; default: all of it)."""
    seed: int = 0
    """Genesis seed: every node initialises the global model identically from it."""
    inner_steps: PositiveInt = 100
    """H: inner AdamW steps per round before a pseudo-gradient is published."""
    batch_size: PositiveInt | None = None
    """Sequences per inner step (default: the preset's)."""
    inner_lr: PositiveFloat | None = None
    """Peak inner AdamW learning rate (default: the preset's)."""
    weight_decay: NonNegativeFloat = 0.1
    """Inner AdamW weight decay."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the inner gradient norm to this value (0 disables clipping)."""
    warmup_steps: NonNegativeInt = 100
    """Linear warmup of the inner learning rate, in inner steps."""
    lr_decay_steps: PositiveInt | None = None
    """Inner steps of cosine decay to 10% of peak (default: max-rounds x H, else 100000)."""
    round_time: PositiveFloat | None = None
    """Dynamic local updates: each round runs as many inner steps as fit in this many seconds
    (at most --inner-steps), so slower hardware publishes smaller updates as often."""
    dynamic_h: bool = False
    """Dynamic local updates sized by throughput: this learner runs H x its inner steps per
    second over the fastest live peer's (as far as that peer's updates bear it out), at least
    H/16; peers report their rates in heartbeats."""
    speed_factor: SpeedFactor = 1.0
    """Emulate slower hardware (tests, benchmarks): each inner step is followed by a sleep of
    F-1 times its measured duration."""
    emulated_step_s: PositiveFloat | None = None
    """With --speed-factor F: pace every inner step to last F times this many seconds instead
    (benchmarks on a shared machine: the emulated speed does not follow its load)."""
    max_rounds: PositiveInt | None = None
    """Stop after this many rounds (default: run until interrupted)."""
    max_time: PositiveFloat | None = None
    """Stop after this many seconds of wall time (default: run until interrupted)."""
    linger: NonNegativeFloat = 0.0
    """After --max-rounds or --max-time, keep serving and merging for this many seconds."""
    linger_until_done: bool = False
    """End --linger early once every live peer has finished and the last updates crossed
    both ways (benchmarks that compare replicas; a lone node would leave at once)."""
    eval_batches: NonNegativeInt = 4
    """Validation batches the replica is evaluated on (0 disables): at start and after
    every --eval-every rounds, on a snapshot, beside training (round_done's val_loss is the
    newest evaluation finished by then; each one is an `evaluated` event)."""
    eval_every: PositiveInt = 1
    """Evaluate the replica after every N-th round only (the evaluation's share of the
    machine, which it takes beside training, divided by N)."""
    device: Annotated[str, OneOf(("auto", "cpu", "cuda"))] = "auto"
    """Training device: auto, cpu or cuda (bf16 autocast on CUDA)."""
    threads: PositiveInt | None = None
    """CPU threads for torch (default: torch's choice)."""
    nproc_per_node: PositiveInt = 1
    """Processes (GPUs) training this node together with torch.distributed, launched with
    torchrun; rank 0 alone talks to the swarm. --batch-size is the node's, split over them."""
    parallel: Annotated[str, OneOf(("ddp", "fsdp"))] = "ddp"
    """How a multi-process node shares the model: ddp (a full copy per GPU) or fsdp (FSDP2,
    parameters, gradients and optimizer state sharded, for models that do not fit one GPU)."""


@dataclass(kw_only=True, config=FLAGS)
class OuterSettings:
    """The outer optimizer every replica steps with the merged pseudo-gradients, and how
    stale updates are corrected against its momentum."""

    outer_optimizer: Annotated[str, OneOf(("nesterov", "delayed_nesterov"))] = "delayed_nesterov"
    """Outer optimizer: nesterov or delayed_nesterov (Liu et al. 2024, the asynchronous default)."""
    outer_lr: PositiveFloat = 0.7
    """Outer learning rate."""
    outer_momentum: Momentum | None = None
    """Outer Nesterov momentum (default 0.9; 0.5 with --codec sparse, whose error feedback
    residual already acts as a momentum)."""
    outer_delay: PositiveInt | None = None
    """Delayed Nesterov: a fixed round of N updates (default: each update's signed count of
    live learners, so a round of the swarm's updates is one outer step at any swarm size)."""
    correction: Annotated[str, OneOf(("none", "heloco", "lookahead"))] = "none"
    """Correction of stale updates before the outer step: none, heloco (shrink the parts
    of a stale update that conflict with the outer momentum, arXiv 2606.00271) or lookahead
    (start each round where the outer momentum will carry the replica before it lands)."""
    correction_strength: CorrectionStrength = 1.0
    """In [0, 100]. heloco: the shrinkage strength k_s, a conflicting block loses
    min(k_s x |cosine| x confidence, 1) of its component along the momentum; lookahead: how
    many times the delay of our last update the start moves ahead."""

    def outer_config(self, codec: str) -> OuterConfig:
        """The outer optimizer; its momentum defaults by the `codec` updates are sent in."""
        from merge.feedback import default_outer_momentum
        from merge.outer import OuterConfig

        momentum = self.outer_momentum
        return OuterConfig(
            kind=self.outer_optimizer,  # type: ignore[arg-type]
            lr=self.outer_lr,
            momentum=default_outer_momentum(codec) if momentum is None else momentum,
            delay=self.outer_delay,
        )

    def correction_config(self) -> CorrectionConfig:
        from merge.correction import CorrectionConfig

        return CorrectionConfig(
            kind=self.correction,  # type: ignore[arg-type]
            strength=self.correction_strength,
        )


@dataclass(kw_only=True, config=FLAGS)
class MergeSettings:
    """How an update is weighed and encoded, and how the model is split for publishing."""

    staleness: Annotated[str, OneOf(STALENESS_KINDS)] = "polynomial"
    """Staleness weighting: constant, polynomial (1+s)^-a, hinge or exponential."""
    staleness_a: NonNegativeFloat = 0.5
    """Parameter a of the staleness function."""
    staleness_b: NonNegativeFloat = 4.0
    """Hinge threshold b: updates at most b rounds stale keep full weight."""
    token_weighting: Annotated[str, OneOf(("tokens", "none"))] = "tokens"
    """Weigh an update by the tokens it trained on (tokens) or not at all (none)."""
    codec: Annotated[str, OneOf((*CODEC_NAMES, AUTO))] = AUTO
    """Encoding of published pseudo-gradients: fp32, bf16, int8 or int4 (blockwise), sparse or
    topk (the largest 2.9% / 9.4% of each 4096 entries, 2 bits each); the lossy four carry
    error feedback. auto (the default): picked at each round start from the uplink this node
    measured (bf16, int8, int4 or topk; bf16 until measured, and always with fragments or
    learner groups). Nodes of one swarm may mix codecs."""
    fragments: PositiveInt = 1
    """Streaming DiLoCo: split the model into P fragments (tensors bin-packed by size) and
    publish fragment p as its own signed update after inner step (p+1)*H/P of each round, so
    uploads spread over the round; every node of a run must use the same P (1: whole updates)."""

    def staleness_config(self) -> StalenessConfig:
        return StalenessConfig(
            kind=self.staleness,  # type: ignore[arg-type]
            a=self.staleness_a,
            b=self.staleness_b,
        )

    def token_weight_config(self, reference_tokens: int) -> TokenWeightConfig:
        """`reference_tokens`: the tokens of a full round, which weigh 1."""
        return TokenWeightConfig(
            kind=self.token_weighting,  # type: ignore[arg-type]
            reference_tokens=reference_tokens,
        )


GroupBits = Annotated[
    int, check(lambda v: 0 <= v <= 16, "{flag} must be an integer in [0, 16], got {value}")
]
Share = Annotated[float, check(lambda v: 0 < v <= 1, "{flag} must be in (0, 1], got {value}")]
GroupSize = Annotated[
    NonNegativeInt,
    check(
        lambda v: v != 2,
        "{flag} 2 is refused: in a group of two either member voids the other's every round"
        " (docs/trust.md); use 3 or more",
    ),
]


@dataclass(kw_only=True, config=FLAGS)
class GroupSettings:
    """Learner groups (docs/scale.md): peers form groups by peer id, a group's members combine
    their pseudo-gradients at a round's end, and the swarm sees one update per group. Off by
    default (--group-size 0: every node is its own learner, updates go all-to-all)."""

    group_size: GroupSize = 0
    """Learner groups: fewest peers a group holds on average (groups split in two as the swarm
    grows, at most 2^--group-max-bits of them); 0: off, every node publishes its own update.
    No group of a split holds fewer than 3 peers (a smaller one joins its sibling); 2 is
    refused, 1 is a node alone as its own group.
    Experimental: a group's members exchange, reduce and co-sign their contributions; other
    peers fetch each group update once from a holder (or by catch-up, as any update), so
    bytes per node grow with the number of groups, not of peers (docs/scale.md)."""
    group_max_bits: GroupBits = 5
    """With --group-size: at most 2^N groups (learners), 32 by default."""
    group_epoch_rounds: PositiveInt = 10
    """With --group-size: rounds per epoch; who is in which group is re-decided once per epoch."""
    group_quorum: Share = 0.5
    """With --group-size: share of a group's members whose contribution must be in by the
    deadline, else the group's round is abandoned (its members keep their pseudo-gradients)."""
    group_max_norm_to_median: NonNegativeFloat = 4.0
    """With --group-size: a member's contribution is clipped to this times the median of its
    group's signed norms (with 3 or more included; 0: off)."""
    group_wait: PositiveFloat = 30.0
    """With --group-size: seconds a member waits for its group's contributions once its own is
    ready (the deadline: who is not in by then is left out of the round, never waited for)."""
    group_scatter: bool = False
    """With --group-size: reduce-scatter (member j reduces shard j of all parts, then shares it)."""
    group_shard_fetch: bool = False
    """With --group-scatter: each member fetches only its slice of other groups' updates and
    the group applies them as one step (docs/scale.md, Session 17; the members' weighted sums
    travel in bf16); any failure falls back to the whole fetch. Experimental."""
    group_fold: bool = False
    """With --group-shard-fetch: the own group's update folded into its members' fetch round
    (docs/scale.md, Session 29): a round's reduced shards go to their replica holder only (the
    others get the co-signature), and the group applies its own update with the others' by
    slices, one fetch round later. Experimental."""

    @property
    def groups_on(self) -> bool:
        return self.group_size > 0

    def grouping_config(self) -> GroupingConfig:
        return GroupingConfig(min_group_size=max(self.group_size, 1), max_bits=self.group_max_bits)

    def reduction_config(self) -> ReductionConfig:
        from merge.group_update import ReductionConfig

        share, k = self.group_quorum, self.group_max_norm_to_median
        return ReductionConfig(quorum_share=share, max_norm_to_median=k)

    def groups_spec(self) -> dict[str, object]:
        """What the run fingerprint holds of the groups (nothing while they are off)."""
        names = ["size", "max_bits", "epoch_rounds", "quorum", "max_norm_to_median", "wait"]
        names += ["scatter"] if self.group_scatter else []  # off: session 11's, unchanged
        names += ["shard_fetch"] if self.group_shard_fetch else []  # off: unchanged
        names += ["fold"] if self.group_fold else []  # off: unchanged
        return {f"group_{n}": getattr(self, f"group_{n}") for n in names}


@dataclass(kw_only=True, config=FLAGS)
class RunSettings(GroupSettings, MergeSettings, OuterSettings, TrainSettings):
    """The sections every node of a run must agree on (the fingerprint is made of them, with
    the model and data they resolve to): train, outer, merge and groups. Not a section of its own:
    the parts that read them together (node/builders.py) take this type."""


@dataclass(kw_only=True, config=FLAGS)
class NetworkSettings:
    """How this node reaches the swarm, and what it holds and serves for its peers."""

    identity: str | None = None
    """Ed25519 identity key file (libp2p format), created with mode 0600 on first use. Not
    given: ~/.diloco/identity.key, or the next free ~/.diloco/identity-N.key while another
    node on this machine holds it; a key given here that is in use is an error."""
    swarm: bool = True
    """Join the peer-to-peer swarm (--no-swarm trains alone, offline)."""
    peers: list[str] | None = None
    """Multiaddrs of any swarm members to join through (default: start a new swarm)."""
    host: str = "0.0.0.0"
    """Address to listen on for peers (use 127.0.0.1 to stay on this machine)."""
    port: int | None = None
    """TCP port to listen on for peers (0: any free port). Not given: 31337, or any free port
    when another node on this machine holds 31337; a port given here that is taken is an
    error."""
    announce: list[str] | None = None
    """Public multiaddrs to announce, e.g. /ip4/203.0.113.7/tcp/31337 behind a port forward."""
    relay: bool = True
    """Relay traffic for peers behind NAT (libp2p circuit relay)."""
    auto_relay: bool = False
    """Be reachable through relays when this node is behind NAT (its --peers are its relays)."""
    relay_max_circuits: int = 16
    """Relayed connections open at once per peer, when relaying for peers behind NAT (with
    --announce; a public node without it relays with go-libp2p's defaults, 16 circuits of
    128 KiB and 2 minutes, until AutoNAT confirms it public: docs/nat.md)."""
    relay_max_mb: float = 1024.0
    """Megabytes one relayed connection carries (each way) before it is reset (with
    --announce, as --relay-max-circuits says)."""
    relay_max_duration: float = 1200.0
    """Seconds one relayed connection lives before it is reset (peers dial a new one; with
    --announce, as --relay-max-circuits says)."""
    client_mode: bool = False
    """Accept no incoming connections: serve no DHT requests, state or update payloads."""
    org: Label = ""
    """Organisation label shown to the swarm (who contributed which hardware)."""
    serve_state: bool = True
    """Let newcomers download this node's replica."""
    heartbeat_period: HeartbeatPeriod = 5.0
    """Seconds between heartbeats; a peer silent for three periods drops out."""
    retain_updates: PositiveInt = 16
    """Updates kept per author to serve to peers that missed them (x P with --fragments P:
    as many rounds)."""
    retain_mb: Megabytes = 256.0
    """Megabytes of retained updates held in memory; beyond it they spill to disk."""
    gap_wait: GapWait = 30.0
    """Seconds an update that no live peer offers is waited for before it counts as lost."""
    allow_keys: str | None = None
    """Permissioned run: TOML or YAML file mapping organizations to the peer ids or Ed25519
    public keys that may contribute; others are ignored and counted (default: open swarm)."""

    @property
    def relay_limits(self) -> RelayLimits:
        return RelayLimits(
            max_circuits=self.relay_max_circuits,
            max_bytes=int(self.relay_max_mb * 1e6),
            max_duration_s=self.relay_max_duration,
        )

    @property
    def listen_port(self) -> int:
        """--port, or the default port when none was given."""
        return DEFAULT_PORT if self.port is None else self.port

    @property
    def identity_path(self) -> Path:
        return Path(DEFAULT_IDENTITY if self.identity is None else self.identity).expanduser()


@dataclass(kw_only=True, config=FLAGS)
class DashboardSettings:
    """The swarm dashboard this node serves in a browser."""

    dashboard_port: Port | None = None
    """Serve the swarm dashboard on this port (0: any free port; default: 8000, or any free
    port when 8000 is taken)."""
    dashboard: bool = True
    """Serve this node's swarm dashboard (--no-dashboard: none)."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard listens on; 0.0.0.0 opens it to the network (set a token)."""
    dashboard_token: str | None = None
    """Require 'Authorization: Bearer TOKEN' on every dashboard route (browser: /?token=TOKEN)."""
    dashboard_token_file: str | None = None
    """Read the dashboard token from this file (mode 0600): unlike --dashboard-token, not in ps."""


@dataclass(kw_only=True, config=FLAGS)
class CheckpointSettings:
    """Where this node keeps its checkpoints, and how often it writes them."""

    checkpoint_dir: str | None = None
    """Checkpoint directory, locked while the node runs; join resumes from it
    (default: ~/.diloco/checkpoints/RUN_ID/PEER_ID)."""
    checkpoint_every: PositiveInt = 10
    """Save a checkpoint every N rounds (and always on Ctrl+C, SIGTERM or SIGHUP)."""


@dataclass(kw_only=True, config=FLAGS)
class LoggingSettings:
    """What this node says, and where its per-round metrics go."""

    tensorboard: str | None = None
    """Write per-round metrics (loss, val loss, tokens/s, staleness, drift, MB, goodput) as
    TensorBoard events under DIR/RUN_ID/PEER_ID."""
    wandb: bool = False
    """Log per-round metrics to Weights & Biases (offline unless WANDB_API_KEY, a wandb login
    or WANDB_MODE says otherwise)."""
    log_level: Annotated[str, OneOf(LOG_LEVELS, case_insensitive=True)] = "INFO"
    """Logging level: DEBUG, INFO, WARNING or ERROR."""
    log_format: Annotated[str, OneOf(("rich", "json"))] = "rich"
    """rich: a live progress line for people; json: one JSON event per line on stdout."""


__all__ = ["FLAGS", "STALENESS_KINDS", "OneOf", "flag"]  # re-exported: callers name them here

SECTIONS: dict[str, tuple[type, str]] = {
    "train": (TrainSettings, "training"),
    "outer": (OuterSettings, "outer optimizer and merging"),
    "merge": (MergeSettings, "outer optimizer and merging"),
    "groups": (GroupSettings, "learner groups"),
    "network": (NetworkSettings, "network"),
    "dashboard": (DashboardSettings, "dashboard"),
    "checkpoint": (CheckpointSettings, "checkpoints"),
    "logging": (LoggingSettings, "logging and tracking"),
}
"""`join`'s sections, in --help order, each with the title of its group there."""
