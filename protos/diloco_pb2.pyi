from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_FP4_E3M0: _ClassVar[Codec]

class ScaleDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCALE_FP32: _ClassVar[ScaleDtype]
    SCALE_FP16: _ClassVar[ScaleDtype]

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_ACCEPTED: _ClassVar[PushOutcome]
    PUSH_DROPPED_STALE: _ClassVar[PushOutcome]
    PUSH_DUPLICATE: _ClassVar[PushOutcome]
    PUSH_REFUSED_NORM: _ClassVar[PushOutcome]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_FP4_E3M0: Codec
SCALE_FP32: ScaleDtype
SCALE_FP16: ScaleDtype
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_ACCEPTED: PushOutcome
PUSH_DROPPED_STALE: PushOutcome
PUSH_DUPLICATE: PushOutcome
PUSH_REFUSED_NORM: PushOutcome

class PayloadHeader(_message.Message):
    __slots__ = ("codec", "numel", "block_size", "scale_dtype", "total_bytes")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    numel: int
    block_size: int
    scale_dtype: ScaleDtype
    total_bytes: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., numel: _Optional[int] = ..., block_size: _Optional[int] = ..., scale_dtype: _Optional[_Union[ScaleDtype, str]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class FragmentSpec(_message.Message):
    __slots__ = ("fragment_id", "tensor_names", "numel")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    numel: int
    def __init__(self, fragment_id: _Optional[int] = ..., tensor_names: _Optional[_Iterable[str]] = ..., numel: _Optional[int] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("tensors", "fragments", "spec_hash")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentSpec]
    spec_hash: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., fragments: _Optional[_Iterable[_Union[FragmentSpec, _Mapping]]] = ..., spec_hash: _Optional[str] = ...) -> None: ...

class FragmentVersion(_message.Message):
    __slots__ = ("fragment_id", "version")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class LearnerCounters(_message.Message):
    __slots__ = ("steps", "tokens", "compute_s", "blocked_s")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_S_FIELD_NUMBER: _ClassVar[int]
    steps: int
    tokens: int
    compute_s: float
    blocked_s: float
    def __init__(self, steps: _Optional[int] = ..., tokens: _Optional[int] = ..., compute_s: _Optional[float] = ..., blocked_s: _Optional[float] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_name", "spec", "learner_id", "session", "shards", "fragment_shards", "evaluator")
    LEARNER_NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_SHARDS_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    learner_name: str
    spec: ModelSpec
    learner_id: str
    session: str
    shards: int
    fragment_shards: _containers.RepeatedScalarFieldContainer[int]
    evaluator: bool
    def __init__(self, learner_name: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., learner_id: _Optional[str] = ..., session: _Optional[str] = ..., shards: _Optional[int] = ..., fragment_shards: _Optional[_Iterable[int]] = ..., evaluator: _Optional[bool] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("learner_id", "lease_s", "heartbeat_interval_s", "server_epoch", "versions", "needs_init", "inner_steps", "next_seq", "session", "inner_steps_scale", "shards", "shard_index", "owned_fragments")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_INIT_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OWNED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    lease_s: float
    heartbeat_interval_s: float
    server_epoch: str
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    needs_init: bool
    inner_steps: int
    next_seq: int
    session: str
    inner_steps_scale: float
    shards: int
    shard_index: int
    owned_fragments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, learner_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., server_epoch: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., needs_init: _Optional[bool] = ..., inner_steps: _Optional[int] = ..., next_seq: _Optional[int] = ..., session: _Optional[str] = ..., inner_steps_scale: _Optional[float] = ..., shards: _Optional[int] = ..., shard_index: _Optional[int] = ..., owned_fragments: _Optional[_Iterable[int]] = ...) -> None: ...

class InitStart(_message.Message):
    __slots__ = ("learner_id", "spec_hash", "session")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    spec_hash: str
    session: str
    def __init__(self, learner_id: _Optional[str] = ..., spec_hash: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class InitFragmentHeader(_message.Message):
    __slots__ = ("fragment_id", "payload")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    payload: PayloadHeader
    def __init__(self, fragment_id: _Optional[int] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ...) -> None: ...

class InitModelRequest(_message.Message):
    __slots__ = ("start", "fragment", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: InitStart
    fragment: InitFragmentHeader
    chunk: Chunk
    def __init__(self, start: _Optional[_Union[InitStart, _Mapping]] = ..., fragment: _Optional[_Union[InitFragmentHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class InitModelReply(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    def __init__(self, versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "counters", "step_time_s", "overlap_steps", "session", "pushes_done")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DONE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    counters: LearnerCounters
    step_time_s: float
    overlap_steps: int
    session: str
    pushes_done: bool
    def __init__(self, learner_id: _Optional[str] = ..., counters: _Optional[_Union[LearnerCounters, _Mapping]] = ..., step_time_s: _Optional[float] = ..., overlap_steps: _Optional[int] = ..., session: _Optional[str] = ..., pushes_done: _Optional[bool] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("server_epoch", "lease_s", "inner_steps", "versions", "inner_steps_scale")
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_SCALE_FIELD_NUMBER: _ClassVar[int]
    server_epoch: str
    lease_s: float
    inner_steps: int
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    inner_steps_scale: float
    def __init__(self, server_epoch: _Optional[str] = ..., lease_s: _Optional[float] = ..., inner_steps: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., inner_steps_scale: _Optional[float] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "seq", "spec_hash", "fragment_id", "base_version", "tokens", "steps", "compute_s", "payload", "session", "slice")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    seq: int
    spec_hash: str
    fragment_id: int
    base_version: int
    tokens: int
    steps: int
    compute_s: float
    payload: PayloadHeader
    session: str
    slice: Slice
    def __init__(self, learner_id: _Optional[str] = ..., seq: _Optional[int] = ..., spec_hash: _Optional[str] = ..., fragment_id: _Optional[int] = ..., base_version: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., compute_s: _Optional[float] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ..., session: _Optional[str] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("rank", "ranks", "starts", "lengths")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ranks: int
    starts: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., ranks: _Optional[int] = ..., starts: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "round_version", "current_version", "staleness", "weight", "message")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ROUND_VERSION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    round_version: int
    current_version: int
    staleness: int
    weight: float
    message: str
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., round_version: _Optional[int] = ..., current_version: _Optional[int] = ..., staleness: _Optional[int] = ..., weight: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "fragment_id", "min_version", "wait_s", "codec", "delta_ok", "have_version", "session", "slice")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DELTA_OK_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment_id: int
    min_version: int
    wait_s: float
    codec: Codec
    delta_ok: bool
    have_version: int
    session: str
    slice: Slice
    def __init__(self, learner_id: _Optional[str] = ..., fragment_id: _Optional[int] = ..., min_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., codec: _Optional[_Union[Codec, str]] = ..., delta_ok: _Optional[bool] = ..., have_version: _Optional[int] = ..., session: _Optional[str] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("fragment_id", "version", "server_epoch", "payload", "delta_from", "links", "checksum")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DELTA_FROM_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    server_epoch: str
    payload: PayloadHeader
    delta_from: int
    links: int
    checksum: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ..., server_epoch: _Optional[str] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ..., delta_from: _Optional[int] = ..., links: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class DeltaLink(_message.Message):
    __slots__ = ("version", "payload")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    version: int
    payload: PayloadHeader
    def __init__(self, version: _Optional[int] = ..., payload: _Optional[_Union[PayloadHeader, _Mapping]] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("header", "chunk", "link")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    link: DeltaLink
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., link: _Optional[_Union[DeltaLink, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "counters", "session")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    counters: LearnerCounters
    session: str
    def __init__(self, learner_id: _Optional[str] = ..., counters: _Optional[_Union[LearnerCounters, _Mapping]] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("learner_id", "session", "versions", "eval_loss", "eval_set")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SET_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: str
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    eval_loss: float
    eval_set: str
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., eval_loss: _Optional[float] = ..., eval_set: _Optional[str] = ...) -> None: ...

class EvalReply(_message.Message):
    __slots__ = ("consumed_tokens", "has_reference", "reference_tokens", "effective_goodput", "below_curve")
    CONSUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    BELOW_CURVE_FIELD_NUMBER: _ClassVar[int]
    consumed_tokens: float
    has_reference: bool
    reference_tokens: float
    effective_goodput: float
    below_curve: bool
    def __init__(self, consumed_tokens: _Optional[float] = ..., has_reference: _Optional[bool] = ..., reference_tokens: _Optional[float] = ..., effective_goodput: _Optional[float] = ..., below_curve: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "name", "state", "counters", "inner_steps", "credential", "evaluator")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    name: str
    state: str
    counters: LearnerCounters
    inner_steps: int
    credential: str
    evaluator: bool
    def __init__(self, learner_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., counters: _Optional[_Union[LearnerCounters, _Mapping]] = ..., inner_steps: _Optional[int] = ..., credential: _Optional[str] = ..., evaluator: _Optional[bool] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("server_epoch", "initialized", "spec_hash", "versions", "learners", "outer_steps", "goodput", "unhealthy", "shards", "shard_index", "model_fraction")
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    server_epoch: str
    initialized: bool
    spec_hash: str
    versions: _containers.RepeatedCompositeFieldContainer[FragmentVersion]
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    outer_steps: int
    goodput: float
    unhealthy: str
    shards: int
    shard_index: int
    model_fraction: float
    def __init__(self, server_epoch: _Optional[str] = ..., initialized: _Optional[bool] = ..., spec_hash: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[FragmentVersion, _Mapping]]] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., outer_steps: _Optional[int] = ..., goodput: _Optional[float] = ..., unhealthy: _Optional[str] = ..., shards: _Optional[int] = ..., shard_index: _Optional[int] = ..., model_fraction: _Optional[float] = ...) -> None: ...
