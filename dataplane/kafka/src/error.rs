/// Everything that can go wrong in this crate. Every variant is about bytes that came from a
/// broker (or a client): the caller closes that one connection and logs the message, which says
/// what was wrong and where, never the record contents.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A record batch header is cut short or declares a length that cannot be right.
    #[error("record batch at offset {base_offset}: {reason}")]
    Batch { base_offset: i64, reason: String },
    /// A batch's CRC-32C does not match its contents.
    #[error(
        "record batch at offset {base_offset}: CRC-32C mismatch (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Crc {
        base_offset: i64,
        stored: u32,
        computed: u32,
    },
    /// A message set in the v0/v1 format, which Kafka 4 removed and Spur does not filter.
    #[error(
        "record batch at offset {base_offset}: magic {magic} (only v2 record batches can be filtered)"
    )]
    Magic { base_offset: i64, magic: i8 },
    /// The batch names a compression codec Kafka does not define.
    #[error("record batch at offset {base_offset}: unknown compression codec {codec}")]
    Codec { base_offset: i64, codec: u8 },
    /// Decompressing the batch failed, or it would exceed the configured limit.
    #[error("record batch at offset {base_offset}: {codec} payload: {reason}")]
    Decompress {
        base_offset: i64,
        codec: &'static str,
        reason: String,
    },
    /// Compressing a rewritten batch failed.
    #[error("record batch at offset {base_offset}: {codec} compression failed: {reason}")]
    Compress {
        base_offset: i64,
        codec: &'static str,
        reason: String,
    },
    /// A record inside a batch is malformed (bad varint, lengths past the end, offsets out of
    /// order, a count that does not match the records).
    #[error("record batch at offset {base_offset}: record {index}: {reason}")]
    Record {
        base_offset: i64,
        index: usize,
        reason: String,
    },
    /// A frame whose size cannot be right.
    #[error("Kafka frame: {reason}")]
    Frame { reason: String },
    /// A request or response that does not decode as its API and version say, or that cannot
    /// be encoded again after a rewrite.
    #[error("Kafka {api} v{version} {side}: {reason}")]
    Message {
        api: String,
        version: i16,
        side: &'static str,
        reason: String,
    },
    /// A response that answers no outstanding request, or more requests in flight than allowed.
    #[error("Kafka connection: {reason}")]
    Protocol { reason: String },
}
