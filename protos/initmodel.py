"""The InitModel upload: the one stream of messages that gives the Synchronizer its first model.

`init_model_requests` yields what every uploader sends (the learner that joins an empty
Synchronizer, `diloco-synchronizer init` from a safetensors file, the tests and benchmarks):
`InitStart` with the learner id and spec hash, then for each fragment in id order its FP32
`PayloadHeader` and its bytes in chunks (to a sharded Synchronizer, each shard's own fragments). Each fragment is encoded when the stream reaches it, so
at most one fragment's bytes are held on top of the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from protos import codec, framing, layout
from protos import diloco_pb2 as pb


def init_model_requests(
    learner_id: str,
    session: str,
    spec_hash: str,
    fragments: Iterable[torch.Tensor],
    chunk_bytes: int = framing.CHUNK_BYTES,
    fragment_ids: Iterable[int] | None = None,
) -> Iterator[pb.InitModelRequest]:
    """The InitModel stream for `fragments`: the parameters of fragment p (or of
    `fragment_ids[p]`, one shard's fragments), any shape, dtype or device (sent flat as FP32
    from the CPU), from the learner that joined as `learner_id` with `session`."""
    yield pb.InitModelRequest(
        start=pb.InitStart(learner_id=learner_id, session=session, spec_hash=spec_hash)
    )
    numbered = (
        enumerate(fragments) if fragment_ids is None else zip(fragment_ids, fragments, strict=True)
    )
    for fragment_id, params in numbered:
        flat = params.detach().to("cpu", torch.float32).reshape(-1)
        header = layout.make_header(pb.CODEC_FP32, flat.numel())
        yield pb.InitModelRequest(
            fragment=pb.InitFragmentHeader(fragment_id=fragment_id, payload=header)
        )
        for chunk in framing.iter_chunks(codec.encode(flat, pb.CODEC_FP32), chunk_bytes):
            yield pb.InitModelRequest(chunk=chunk)
