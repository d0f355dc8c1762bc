"""Configuration of a node: one dataclass whose field docstrings double as CLI help."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dht.addresses import host_ip, listen_maddrs, parse_announce_maddr, parse_peer_maddr
from dht.reachability import RelayLimits
from merge.allowlist import AllowList
from merge.codecs import CODECS
from merge.identity import read_secret_file
from node.data import parse_data_slice
from node.flags import add_dataclass_arguments, dataclass_from_args, flag_name
from node.presets import MODEL_NAMES, auto_model
from node.presets import MODEL_SIZES as MODEL_SIZES  # re-exported: callers name them here
from node.presets import model_size as model_size

DILOCO_HOME = Path("~/.diloco")
DEFAULT_PORT = 31337
"""Where a node listens when --port is not given (and that port is free)."""
DEFAULT_IDENTITY = str(DILOCO_HOME / "identity.key")
"""The key a node uses when --identity is not given (and no other node here holds it)."""


@dataclass(kw_only=True)
class JoinConfig:
    """Everything `diloco-node join` needs. Run-level fields enter the run fingerprint."""

    run_id: str = "diloco-default"
    """Name of the run; nodes with the same run id, model and merge settings train together."""
    model: str = "auto"
    """Model: tiny (~0.4M params), small (~10M params), base (~125M params), or a transformers
    architecture of that size, hf:ARCH-SIZE with ARCH llama or gpt2 (e.g. hf:llama-small);
    auto: tiny on a CPU, small on a GPU under 16 GiB, base above. The run's fingerprint holds
    the model auto picked, and the join command a node prints names it: a node whose auto
    picks another model is refused by the swarm with the --model to pass."""
    data: str | None = None
    """Text file, directory of text files or uint16 .bin; default: this Python's stdlib source."""
    data_slice: str | None = None
    """K/N: train only on the K-th of N equal contiguous slices of the training split, so nodes
    on different slices see different data (emulates non-IID learners; default: all of it)."""
    seed: int = 0
    """Genesis seed: every node initialises the global model identically from it."""
    inner_steps: int = 100
    """H: inner AdamW steps per round before a pseudo-gradient is published."""
    batch_size: int | None = None
    """Sequences per inner step (default: the preset's)."""
    inner_lr: float | None = None
    """Peak inner AdamW learning rate (default: the preset's)."""
    weight_decay: float = 0.1
    """Inner AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the inner gradient norm to this value (0 disables clipping)."""
    warmup_steps: int = 100
    """Linear warmup of the inner learning rate, in inner steps."""
    lr_decay_steps: int | None = None
    """Inner steps of cosine decay to 10% of peak (default: max-rounds x H, else 100000)."""
    outer_optimizer: str = "delayed_nesterov"
    """Outer optimizer: nesterov or delayed_nesterov (Liu et al. 2024, the asynchronous default)."""
    outer_lr: float = 0.7
    """Outer learning rate."""
    outer_momentum: float | None = None
    """Outer Nesterov momentum (default 0.9; 0.5 with --codec sparse, whose error feedback
    residual already acts as a momentum)."""
    outer_delay: int | None = None
    """Delayed Nesterov: a fixed round of N updates (default: each update's signed count of
    live learners, so a round of the swarm's updates is one outer step at any swarm size)."""
    correction: str = "none"
    """Correction of stale updates before the outer step: none, heloco (shrink the parts
    of a stale update that conflict with the outer momentum, arXiv 2606.00271) or lookahead
    (start each round where the outer momentum will carry the replica before it lands)."""
    correction_strength: float = 1.0
    """In [0, 100]. heloco: the shrinkage strength k_s, a conflicting block loses
    min(k_s x |cosine| x confidence, 1) of its component along the momentum; lookahead: how
    many times the delay of our last update the start moves ahead."""
    staleness: str = "polynomial"
    """Staleness weighting: constant, polynomial (1+s)^-a, hinge or exponential."""
    staleness_a: float = 0.5
    """Parameter a of the staleness function."""
    staleness_b: float = 4.0
    """Hinge threshold b: updates at most b rounds stale keep full weight."""
    token_weighting: str = "tokens"
    """Weigh an update by the tokens it trained on (tokens) or not at all (none)."""
    codec: str = "bf16"
    """Encoding of published pseudo-gradients: fp32, bf16, int8 or int4 (blockwise), or sparse
    (top 2.9% of each 4096 entries, 2 bits each); the last three carry error feedback."""
    fragments: int = 1
    """Streaming DiLoCo: split the model into P fragments (tensors bin-packed by size) and
    publish fragment p as its own signed update after inner step (p+1)*H/P of each round, so
    uploads spread over the round; every node of a run must use the same P (1: whole updates)."""
    round_time: float | None = None
    """Dynamic local updates: each round runs as many inner steps as fit in this many seconds
    (at most --inner-steps), so slower hardware publishes smaller updates as often."""
    dynamic_h: bool = False
    """Dynamic local updates sized by throughput: this learner runs H x its inner steps per
    second over the fastest live peer's (as far as that peer's updates bear it out), at least
    H/16; peers report their rates in heartbeats."""
    speed_factor: float = 1.0
    """Emulate slower hardware (tests, benchmarks): each inner step is followed by a sleep of
    F-1 times its measured duration."""
    emulated_step_s: float | None = None
    """With --speed-factor F: pace every inner step to last F times this many seconds instead
    (benchmarks on a shared machine: the emulated speed does not follow its load)."""
    max_rounds: int | None = None
    """Stop after this many rounds (default: run until interrupted)."""
    max_time: float | None = None
    """Stop after this many seconds of wall time (default: run until interrupted)."""
    linger: float = 0.0
    """After --max-rounds or --max-time, keep serving and merging for this many seconds."""
    linger_until_done: bool = False
    """End --linger early once every live peer has finished and the last updates crossed
    both ways (benchmarks that compare replicas; a lone node would leave at once)."""
    eval_batches: int = 4
    """Validation batches the replica is evaluated on (0 disables): at start and after
    every --eval-every rounds, on a snapshot, beside training (round_done's val_loss is the
    newest evaluation finished by then; each one is an `evaluated` event)."""
    eval_every: int = 1
    """Evaluate the replica after every N-th round only (the evaluation's share of the
    machine, which it takes beside training, divided by N)."""
    checkpoint_dir: str | None = None
    """Checkpoint directory, locked while the node runs; join resumes from it
    (default: ~/.diloco/checkpoints/RUN_ID/PEER_ID)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N rounds (and always on Ctrl+C, SIGTERM or SIGHUP)."""
    identity: str | None = None
    """Ed25519 identity key file (libp2p format), created with mode 0600 on first use. Not
    given: ~/.diloco/identity.key, or the next free ~/.diloco/identity-N.key while another
    node on this machine holds it; a key given here that is in use is an error."""
    device: str = "auto"
    """Training device: auto, cpu or cuda (bf16 autocast on CUDA)."""
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)."""
    nproc_per_node: int = 1
    """Processes (GPUs) training this node together with torch.distributed, launched with
    torchrun; rank 0 alone talks to the swarm. --batch-size is the node's, split over them."""
    parallel: str = "ddp"
    """How a multi-process node shares the model: ddp (a full copy per GPU) or fsdp (FSDP2,
    parameters, gradients and optimizer state sharded, for models that do not fit one GPU)."""
    tensorboard: str | None = None
    """Write per-round metrics (loss, val loss, tokens/s, staleness, drift, MB, goodput) as
    TensorBoard events under DIR/RUN_ID/PEER_ID."""
    wandb: bool = False
    """Log per-round metrics to Weights & Biases (offline unless WANDB_API_KEY, a wandb login
    or WANDB_MODE says otherwise)."""
    log_level: str = "INFO"
    """Logging level: DEBUG, INFO, WARNING or ERROR."""
    log_format: str = "rich"
    """rich: a live progress line for people; json: one JSON event per line on stdout."""
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
    """Relayed connections open at once per peer, when relaying for peers behind NAT."""
    relay_max_mb: float = 1024.0
    """Megabytes one relayed connection carries (each way) before it is reset."""
    relay_max_duration: float = 1200.0
    """Seconds one relayed connection lives before it is reset (peers dial a new one)."""
    client_mode: bool = False
    """Accept no incoming connections: serve no DHT requests, state or update payloads."""
    org: str = ""
    """Organisation label shown to the swarm (who contributed which hardware)."""
    serve_state: bool = True
    """Let newcomers download this node's replica."""
    heartbeat_period: float = 5.0
    """Seconds between heartbeats; a peer silent for three periods drops out."""
    retain_updates: int = 16
    """Updates kept per author to serve to peers that missed them (x P with --fragments P:
    as many rounds)."""
    retain_mb: float = 256.0
    """Megabytes of retained updates held in memory; beyond it they spill to disk."""
    gap_wait: float = 30.0
    """Seconds an update that no live peer offers is waited for before it counts as lost."""
    dashboard_port: int | None = None
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
    allow_keys: str | None = None
    """Permissioned run: TOML or YAML file mapping organizations to the peer ids or Ed25519
    public keys that may contribute; others are ignored and counted (default: open swarm)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "model": ("auto", *MODEL_NAMES),
        "outer_optimizer": ("nesterov", "delayed_nesterov"),
        "staleness": ("constant", "polynomial", "hinge", "exponential"),
        "token_weighting": ("tokens", "none"),
        "correction": ("none", "heloco", "lookahead"),
        "codec": tuple(CODECS),
        "device": ("auto", "cpu", "cuda"),
        "parallel": ("ddp", "fsdp"),
        "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
        "log_format": ("rich", "json"),
    }
    FLAG_GROUPS: ClassVar[dict[str, tuple[str, ...]]] = {
        "training": (
            "run_id", "model", "data", "data_slice", "seed", "inner_steps", "round_time",
            "dynamic_h", "batch_size", "inner_lr", "weight_decay", "grad_clip", "warmup_steps",
            "lr_decay_steps", "max_rounds", "max_time", "linger", "linger_until_done",
            "eval_batches", "eval_every", "device", "threads", "nproc_per_node", "parallel",
            "speed_factor", "emulated_step_s",
        ),
        "outer optimizer and merging": (
            "outer_optimizer", "outer_lr", "outer_momentum", "outer_delay", "staleness",
            "staleness_a", "staleness_b", "token_weighting", "correction", "correction_strength",
            "codec",
            "fragments",
        ),
        "network": (
            "swarm", "peers", "host", "port", "announce", "relay", "auto_relay", "client_mode",
            "relay_max_circuits", "relay_max_mb", "relay_max_duration",
            "identity", "org", "serve_state", "heartbeat_period", "retain_updates", "retain_mb",
            "gap_wait", "allow_keys",
        ),
        "dashboard": (
            "dashboard", "dashboard_port", "dashboard_host", "dashboard_token",
            "dashboard_token_file",
        ),
        "checkpoints": ("checkpoint_dir", "checkpoint_every"),
        "logging and tracking": ("log_level", "log_format", "tensorboard", "wandb"),
    }  # fmt: skip
    """`join --help` shows the flags in these groups (a field in none goes under "other")."""

    def __post_init__(self) -> None:
        if self.model == "auto":
            self.model = auto_model(self.device)
        for name, allowed in self.CHOICES.items():
            value = getattr(self, name)
            _check_choice(flag_name(name), value.upper() if name == "log_level" else value, allowed)
        _check_positive("nproc_per_node", self.nproc_per_node)
        if not self.run_id or len(self.run_id) > 64:
            raise ValueError("--run-id must be 1 to 64 characters long")
        for name in ("inner_steps", "checkpoint_every", "fragments", "eval_every"):
            _check_positive(name, getattr(self, name))
        self._check_fragments()
        for name in ("batch_size", "max_rounds", "threads", "lr_decay_steps", "outer_delay"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)
        for name in ("inner_lr", "max_time", "outer_lr", "round_time", "emulated_step_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{flag_name(name)} must be a positive number, got {value}")
        for name in ("weight_decay", "grad_clip", "staleness_a", "staleness_b", "linger"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{flag_name(name)} must be a non-negative number, got {value}")
        if not 1.0 <= self.speed_factor <= 1000.0:
            raise ValueError(f"--speed-factor must be between 1 and 1000, got {self.speed_factor}")
        if self.data_slice is not None:
            parse_data_slice(self.data_slice)
        if not (math.isfinite(self.correction_strength) and 0 <= self.correction_strength <= 100):
            raise ValueError(
                f"--correction-strength must be in [0, 100], got {self.correction_strength}"
            )
        if self.correction == "lookahead" and self.fragments > 1:
            raise ValueError("--correction lookahead is not available with --fragments > 1")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        self.host = host_ip(self.host)  # raises for a bad --host; localhost is 127.0.0.1
        listen_maddrs(self.host, self.listen_port)  # raises for a bad --port
        self.peers = [str(parse_peer_maddr(p)) for p in self.peers or []] or None
        self.announce = [str(parse_announce_maddr(a)) for a in self.announce or []] or None
        _ = self.relay_limits  # raises for a bad --relay-max-*
        if not 0.2 <= self.heartbeat_period <= 3600:
            raise ValueError("--heartbeat-period must be between 0.2 and 3600 seconds")
        _check_positive("retain_updates", self.retain_updates)
        if not 0 <= self.retain_mb <= 1e7:
            raise ValueError("--retain-mb must be between 0 and 10000000")
        if not 0 < self.gap_wait <= 86400:
            raise ValueError("--gap-wait must be between 0 and 86400 seconds")
        if len(self.org) > 64:
            raise ValueError("--org must be at most 64 characters long")
        if self.warmup_steps < 0 or self.eval_batches < 0:
            raise ValueError("--warmup-steps and --eval-batches must not be negative")
        self._check_dashboard()

    def _check_fragments(self) -> None:
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"--fragments must be at most --inner-steps ({self.inner_steps}): one fragment "
                f"is published per inner step at most, got {self.fragments}"
            )
        if self.fragments > 1 and self.nproc_per_node > 1:
            raise ValueError("--fragments above 1 needs --nproc-per-node 1")

    def _check_dashboard(self) -> None:
        if self.dashboard_port is not None and not 0 <= self.dashboard_port <= 65535:
            raise ValueError(
                f"--dashboard-port must be between 0 and 65535, got {self.dashboard_port}"
            )
        try:
            if self.dashboard_host.strip().lower() == "localhost":
                self.dashboard_host = "127.0.0.1"
            ipaddress.ip_address(self.dashboard_host)
        except ValueError:
            host = self.dashboard_host
            raise ValueError(
                f"--dashboard-host must be an IP address such as 127.0.0.1, got '{host}'"
            ) from None
        if self.dashboard_token_file is not None:
            if self.dashboard_token is not None:
                raise ValueError("give --dashboard-token or --dashboard-token-file, not both")
            self.dashboard_token = read_secret_file(
                self.dashboard_token_file, "--dashboard-token-file"
            )
        if self.allow_keys is not None:
            AllowList.load(self.allow_keys)  # one clear error now, not after the swarm starts
        token = self.dashboard_token
        if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
            raise ValueError("--dashboard-token must be printable ASCII without spaces")

    def checkpoint_path(self, peer_id: str) -> Path:
        """--checkpoint-dir, else ~/.diloco/checkpoints/RUN_ID/PEER_ID (one per node)."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir).expanduser()
        return (self.run_checkpoints / peer_id).expanduser()

    @property
    def run_checkpoints(self) -> Path:
        """Where this run's nodes keep their default checkpoint dirs (and did before 0.2:
        directly in it)."""
        return (DILOCO_HOME / "checkpoints" / self.run_id).expanduser()

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


def run_fingerprint(run_spec: dict[str, Any]) -> str:
    """Hash of everything that must agree for two nodes to train the same model."""
    canonical = json.dumps(run_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name} must be one of {', '.join(choices)}; got '{value}'")


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"--{flag_name(name)} must be a positive integer, got {value}")


__all__ = [
    "JoinConfig",
    "run_fingerprint",
    "add_dataclass_arguments",
    "dataclass_from_args",
]
