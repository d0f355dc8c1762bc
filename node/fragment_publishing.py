"""Fragment streams (Streaming DiLoCo, `--fragments P`): fragment p of the model is published
after inner step (p+1)*H/P of each round (node.streaming); a stopping node flushes each
fragment's error feedback residual once, dense (node.publishing's FLUSH_CODEC).

The `RoundPublishing` for fragments; node.publishing holds the one for whole updates and the
`Publisher` both seal through.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from merge.codec_base import Codec
from merge.codecs import get_codec
from node.events import EventLog
from node.learner import Learner, RoundStats, StepStats
from node.progress import RoundProgress
from node.publishing import FLUSH_CODEC, Published, Publisher
from node.stats import NodeStats
from node.streaming import FragmentCompressors, FragmentStream


class FragmentStreams:
    """Fragment p is published after inner step (p+1)*H/P of each round (node.streaming);
    the learner then adopts the merged fragment, so its next round starts from there."""

    def __init__(
        self,
        publisher: Publisher,
        learner: Learner,
        codec: Codec,
        inner_steps: int,
        stats: NodeStats,
        events: EventLog,
    ) -> None:
        self.publisher, self.learner, self.inner_steps = publisher, learner, inner_steps
        self.replica, self.stats, self.events = publisher.replica, stats, events
        layout = self.replica.layout
        assert layout is not None, "fragment streams need a replica split in fragments"
        self.layout = layout
        self.compressors = FragmentCompressors(codec, layout)
        self.stream: FragmentStream | None = None
        self.published: list[Published] = []
        self._last_work: dict[int, tuple[int, int, float]] = {}
        """Per fragment, the last round of it this process published: steps, tokens, loss."""

    def begin(self, partial: RoundProgress | None) -> RoundProgress:
        """The learner keeps its params from round to round (each fragment adopts the
        replica's at its own publication); only a new stream starts from the replica."""
        self.published = []
        if self.stream is None:
            base, base_applied = self.replica.snapshot()
            start = self.compressors.round_start(base)  # minus what was not sent yet
            self.learner.load_params(start)
            self.stream = FragmentStream(self.layout, self.inner_steps, start, base_applied)
        return RoundProgress(self.stream.base, self.stream.rounds[0].base_applied)

    def on_step(self, step: int, stats: StepStats) -> None:
        stream = self.stream
        assert stream is not None
        stream.record_step(stats.tokens, stats.loss)
        for fragment in stream.due(step):
            self._publish(stream, fragment, step)

    def finish(
        self, base: RoundProgress, stats: RoundStats, params: torch.Tensor | None = None
    ) -> None:
        if params is not None:  # published from the learner's params as each fragment is due
            raise ValueError("a round of fragment streams is never set aside")
        stream = self.stream
        assert stream is not None
        for fragment in stream.unpublished(stats.num_steps):  # cut by --round-time
            self._publish(stream, fragment, stats.num_steps)

    def interrupted(self, done: RoundProgress) -> RoundProgress | None:
        """The fragments due so far are published; the others' steps since their last
        publication are dropped, and the next round starts afresh."""
        self.stream = None
        return None

    def holds_learner_params(self) -> bool:
        return self.stream is not None

    def keeps_partial_rounds(self) -> bool:
        return False

    def error_feedback(self) -> FragmentCompressors:
        return self.compressors

    def flush(self) -> Published | None:
        """Each fragment's residual as one bf16 flush fragment update, weighed like the last
        round this process published of that fragment, based on the replica as it is now.
        One Published for them all (RoundPublishing.flush's one): the bytes summed, the
        result of the first one our pipeline refused, else of the last one."""
        flushed = []
        codec = get_codec(FLUSH_CODEC)
        for fragment, work in sorted(self._last_work.items()):
            compressor = self.compressors.part(fragment)
            if not compressor.pending():
                continue
            residual, payload = compressor.flush(codec)
            flushed.append(
                self.publisher.publish(
                    residual,
                    _sent_as(payload),
                    self.replica.progress,
                    work,
                    fragment,
                    codec=codec,
                    flush=True,
                )  # fmt: skip
            )
        if not flushed:
            return None
        self.published.extend(flushed)
        refused = [f for f in flushed if not f.result.accepted]
        return Published(
            (refused or flushed)[0 if refused else -1].result,
            sum(f.update_bytes for f in flushed),
            sum(f.encode_s for f in flushed),
            sum(f.seal_s for f in flushed),
            sum(f.merge_s for f in flushed),
        )

    def _publish(self, stream: FragmentStream, fragment: int, step: int) -> None:
        r = stream.rounds[fragment]
        if r.steps == 0:
            return
        inner = self.learner.params_vector()
        work = (r.steps, r.tokens, r.loss)
        published = self.publisher.publish(
            stream.pseudo_gradient(fragment, inner),
            lambda g: self.compressors.encode(fragment, g),
            r.base_applied,
            work,
            fragment,
        )
        self._last_work[fragment] = work
        self.published.append(published)
        merged, applied = self.replica.fragment_params(fragment)
        start = self.compressors.fragment_start(fragment, merged)  # minus what was not sent
        self.layout.scatter(inner, fragment, start)
        self.learner.load_params(inner)
        stream.adopt(fragment, start, applied)
        self.events.emit(
            "fragment_published",
            round=self.stats.round + 1,
            step=step,
            fragment=fragment,
            seq=self.stats.seq if published.result.accepted else None,
            update_bytes=published.update_bytes,
        )


def _sent_as(payload: bytes) -> Callable[[torch.Tensor], bytes]:
    """An `encode` for Publisher.publish that returns a payload encoded already."""
    return lambda _: payload
