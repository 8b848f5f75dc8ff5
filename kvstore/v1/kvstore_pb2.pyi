from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Namespace(_message.Message):
    __slots__ = ("model", "revision", "dtype", "layout", "block_size", "tp_size", "tp_rank", "adapter", "cache_salt", "hash_algorithm", "kv_encoding")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODING_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    dtype: str
    layout: str
    block_size: int
    tp_size: int
    tp_rank: int
    adapter: str
    cache_salt: str
    hash_algorithm: str
    kv_encoding: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., block_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., adapter: _Optional[str] = ..., cache_salt: _Optional[str] = ..., hash_algorithm: _Optional[str] = ..., kv_encoding: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "agent_session_id", "ttl_s", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    agent_session_id: str
    ttl_s: float
    request_id: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "tier_names", "block_tiers")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_NAMES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TIERS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    tier_names: _containers.RepeatedScalarFieldContainer[str]
    block_tiers: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., tier_names: _Optional[_Iterable[str]] = ..., block_tiers: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("offset", "total_bytes", "data", "last")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    total_bytes: int
    data: bytes
    last: bool
    def __init__(self, offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "priority", "retention_s", "block_hash", "total_bytes", "block_index", "offset", "data", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    priority: int
    retention_s: float
    block_hash: bytes
    total_bytes: int
    block_index: int
    offset: int
    data: bytes
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., priority: _Optional[int] = ..., retention_s: _Optional[float] = ..., block_hash: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_blocks")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_blocks: int
    def __init__(self, num_stored: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "demotions", "promotions", "corrupt_records", "counters", "state", "last_error", "logical_bytes", "pinned_bytes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    corrupt_records: int
    counters: _containers.ScalarMap[str, int]
    state: str
    last_error: str
    logical_bytes: int
    pinned_bytes: int
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., corrupt_records: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., logical_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "lookup_hit_blocks", "lookup_miss_blocks", "missed_blocks", "reuse_gap_counts", "reuse_gap_sum_s", "counters")
    class MissedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REUSE_GAP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REUSE_GAP_SUM_S_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookup_hit_blocks: int
    lookup_miss_blocks: int
    missed_blocks: _containers.ScalarMap[str, int]
    reuse_gap_counts: _containers.RepeatedScalarFieldContainer[int]
    reuse_gap_sum_s: float
    counters: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookup_hit_blocks: _Optional[int] = ..., lookup_miss_blocks: _Optional[int] = ..., missed_blocks: _Optional[_Mapping[str, int]] = ..., reuse_gap_counts: _Optional[_Iterable[int]] = ..., reuse_gap_sum_s: _Optional[float] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "request_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    request_id: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., request_id: _Optional[str] = ...) -> None: ...

class BlockExplanation(_message.Message):
    __slots__ = ("position", "hit", "tier", "cause", "detail", "removed_s", "removed_from", "priority", "namespace_fields", "block_hash")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REMOVED_S_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    position: int
    hit: bool
    tier: str
    cause: str
    detail: str
    removed_s: float
    removed_from: str
    priority: int
    namespace_fields: _containers.RepeatedScalarFieldContainer[str]
    block_hash: bytes
    def __init__(self, position: _Optional[int] = ..., hit: _Optional[bool] = ..., tier: _Optional[str] = ..., cause: _Optional[str] = ..., detail: _Optional[str] = ..., removed_s: _Optional[float] = ..., removed_from: _Optional[str] = ..., priority: _Optional[int] = ..., namespace_fields: _Optional[_Iterable[str]] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("blocks", "near_namespace", "namespace")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEAR_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockExplanation]
    near_namespace: Namespace
    namespace: Namespace
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockExplanation, _Mapping]]] = ..., near_namespace: _Optional[_Union[Namespace, _Mapping]] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class CapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SharedMemoryOffer(_message.Message):
    __slots__ = ("host_id", "handoff_socket")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SOCKET_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    handoff_socket: str
    def __init__(self, host_id: _Optional[str] = ..., handoff_socket: _Optional[str] = ...) -> None: ...

class EventsOffer(_message.Message):
    __slots__ = ("endpoint", "replay_endpoint", "topic", "authenticated")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    replay_endpoint: str
    topic: str
    authenticated: bool
    def __init__(self, endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., topic: _Optional[str] = ..., authenticated: _Optional[bool] = ...) -> None: ...

class CapabilitiesResponse(_message.Message):
    __slots__ = ("shared_memory", "bulk", "events")
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    shared_memory: SharedMemoryOffer
    bulk: BulkOffer
    events: EventsOffer
    def __init__(self, shared_memory: _Optional[_Union[SharedMemoryOffer, _Mapping]] = ..., bulk: _Optional[_Union[BulkOffer, _Mapping]] = ..., events: _Optional[_Union[EventsOffer, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("release_lease_ids",)
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, release_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("session_id", "grant", "get_segment_bytes", "put_segment_bytes", "lease_s", "grant_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    GET_SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUT_SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    GRANT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    grant: bytes
    get_segment_bytes: int
    put_segment_bytes: int
    lease_s: float
    grant_s: float
    def __init__(self, session_id: _Optional[int] = ..., grant: _Optional[bytes] = ..., get_segment_bytes: _Optional[int] = ..., put_segment_bytes: _Optional[int] = ..., lease_s: _Optional[float] = ..., grant_s: _Optional[float] = ...) -> None: ...

class GetSharedRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "session_id", "in_place", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: int
    in_place: bool
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[int] = ..., in_place: _Optional[bool] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class SlabOffer(_message.Message):
    __slots__ = ("slab_id", "nbytes", "touched")
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    slab_id: int
    nbytes: int
    touched: int
    def __init__(self, slab_id: _Optional[int] = ..., nbytes: _Optional[int] = ..., touched: _Optional[int] = ...) -> None: ...

class GetSharedResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "sizes", "no_room", "slabs", "new_slabs", "retired_slabs")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    NEW_SLABS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_SLABS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    no_room: bool
    slabs: _containers.RepeatedScalarFieldContainer[int]
    new_slabs: _containers.RepeatedCompositeFieldContainer[SlabOffer]
    retired_slabs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., no_room: _Optional[bool] = ..., slabs: _Optional[_Iterable[int]] = ..., new_slabs: _Optional[_Iterable[_Union[SlabOffer, _Mapping]]] = ..., retired_slabs: _Optional[_Iterable[int]] = ...) -> None: ...

class PutSharedRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "priority", "retention_s", "block_hashes", "offsets", "sizes", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    session_id: int
    priority: int
    retention_s: float
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., session_id: _Optional[int] = ..., priority: _Optional[int] = ..., retention_s: _Optional[float] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class BulkOffer(_message.Message):
    __slots__ = ("port", "host", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    host: str
    tls: bool
    def __init__(self, port: _Optional[int] = ..., host: _Optional[str] = ..., tls: _Optional[bool] = ...) -> None: ...

class BulkGetRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class BulkGetResponse(_message.Message):
    __slots__ = ("grant", "sizes", "grant_s", "no_room")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    GRANT_S_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    grant: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    grant_s: float
    no_room: bool
    def __init__(self, grant: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., grant_s: _Optional[float] = ..., no_room: _Optional[bool] = ...) -> None: ...

class BulkPutRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "sizes", "priority", "retention_s", "agent_session_id", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    retention_s: float
    agent_session_id: str
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., retention_s: _Optional[float] = ..., agent_session_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class BulkPutResponse(_message.Message):
    __slots__ = ("grant", "grant_s", "no_room", "stored")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    GRANT_S_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    grant: bytes
    grant_s: float
    no_room: bool
    stored: PutResponse
    def __init__(self, grant: _Optional[bytes] = ..., grant_s: _Optional[float] = ..., no_room: _Optional[bool] = ..., stored: _Optional[_Union[PutResponse, _Mapping]] = ...) -> None: ...
