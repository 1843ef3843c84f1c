from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "offset", "length")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    offset: int
    length: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_len", "present")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, prefix_len: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("backend", "objects", "bytes_used", "capacity_bytes", "hits", "misses", "evictions", "leased", "pinned", "max_object_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    objects: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    leased: int
    pinned: int
    max_object_bytes: int
    def __init__(self, backend: _Optional[str] = ..., objects: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., leased: _Optional[int] = ..., pinned: _Optional[int] = ..., max_object_bytes: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "backend", "instance_id")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    status: str
    backend: str
    instance_id: str
    def __init__(self, status: _Optional[str] = ..., backend: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ShmInfo(_message.Message):
    __slots__ = ("dir", "token")
    DIR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    dir: str
    token: str
    def __init__(self, dir: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class ShmObject(_message.Message):
    __slots__ = ("key", "metadata", "file", "size", "found", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    metadata: bytes
    file: str
    size: int
    found: bool
    checksum: bytes
    def __init__(self, key: _Optional[str] = ..., metadata: _Optional[bytes] = ..., file: _Optional[str] = ..., size: _Optional[int] = ..., found: _Optional[bool] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class ShmPutRequest(_message.Message):
    __slots__ = ("objects", "ttl_s")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ShmObject]
    ttl_s: float
    def __init__(self, objects: _Optional[_Iterable[_Union[ShmObject, _Mapping]]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ShmGetResponse(_message.Message):
    __slots__ = ("objects",)
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[ShmObject]
    def __init__(self, objects: _Optional[_Iterable[_Union[ShmObject, _Mapping]]] = ...) -> None: ...
