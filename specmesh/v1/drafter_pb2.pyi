from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterRequest(_message.Message):
    __slots__ = ("session_id", "open", "extend", "commit", "close")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    open: OpenSession
    extend: ExtendSession
    commit: CommitStep
    close: CloseSession
    def __init__(self, session_id: _Optional[str] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., extend: _Optional[_Union[ExtendSession, _Mapping]] = ..., commit: _Optional[_Union[CommitStep, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("context", "sampling", "budget", "depth", "pipelined", "features", "push_predrafts", "fixed_shape", "verify_cost", "structured", "shares_cores", "verifier")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PUSH_PREDRAFTS_FIELD_NUMBER: _ClassVar[int]
    FIXED_SHAPE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    SHARES_CORES_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    context: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    budget: int
    depth: int
    pipelined: bool
    features: bytes
    push_predrafts: bool
    fixed_shape: bool
    verify_cost: _containers.RepeatedCompositeFieldContainer[CostPoint]
    structured: _common_pb2.StructuredOutput
    shares_cores: bool
    verifier: str
    def __init__(self, context: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ..., pipelined: _Optional[bool] = ..., features: _Optional[bytes] = ..., push_predrafts: _Optional[bool] = ..., fixed_shape: _Optional[bool] = ..., verify_cost: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., structured: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., shares_cores: _Optional[bool] = ..., verifier: _Optional[str] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("rows", "seconds")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    seconds: float
    def __init__(self, rows: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ExtendSession(_message.Message):
    __slots__ = ("tokens", "budget", "depth", "keep", "features", "structured", "same_turn")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    SAME_TURN_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    budget: int
    depth: int
    keep: int
    features: bytes
    structured: _common_pb2.StructuredOutput
    same_turn: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ..., keep: _Optional[int] = ..., features: _Optional[bytes] = ..., structured: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., same_turn: _Optional[bool] = ...) -> None: ...

class CommitStep(_message.Message):
    __slots__ = ("step", "accepted", "bonus", "budget", "depth", "features", "took_predraft", "verify_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOOK_PREDRAFT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    budget: int
    depth: int
    features: bytes
    took_predraft: bool
    verify_s: float
    def __init__(self, step: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., budget: _Optional[int] = ..., depth: _Optional[int] = ..., features: _Optional[bytes] = ..., took_predraft: _Optional[bool] = ..., verify_s: _Optional[float] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("session_id", "step", "position", "tree", "predrafted", "error", "ahead", "plain_steps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    position: int
    tree: _common_pb2.DraftTree
    predrafted: bool
    error: str
    ahead: Ahead
    plain_steps: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., position: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., predrafted: _Optional[bool] = ..., error: _Optional[str] = ..., ahead: _Optional[_Union[Ahead, _Mapping]] = ..., plain_steps: _Optional[int] = ...) -> None: ...

class Ahead(_message.Message):
    __slots__ = ("accepted", "depth")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    depth: int
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., depth: _Optional[int] = ...) -> None: ...
