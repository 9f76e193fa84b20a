//! The v2 record batch header (`RecordBatch` in Kafka's `DefaultRecordBatch`), read and written
//! field by field: 61 bytes, big-endian, CRC-32C over everything after the `crc` field.

use crate::Error;
use crate::codec::Codec;

/// Bytes before the records: the fixed v2 header.
pub const HEADER_LEN: usize = 61;
/// Bytes of `baseOffset` and `batchLength`, which `batchLength` does not count.
pub const LOG_OVERHEAD: usize = 12;
/// Where the CRC-32C's input starts (the `attributes` field).
const CRC_START: usize = 21;

const ATTR_CODEC: u16 = 0x07;
const ATTR_LOG_APPEND_TIME: u16 = 0x08;
const ATTR_TRANSACTIONAL: u16 = 0x10;
const ATTR_CONTROL: u16 = 0x20;

/// A v2 batch header, as stored. Fields the filter does not change are kept bit for bit by
/// copying the original header bytes; this type reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    pub base_offset: i64,
    /// Bytes after this field: the header's last 49 bytes plus the records.
    pub batch_length: i32,
    pub partition_leader_epoch: i32,
    pub magic: i8,
    pub crc: u32,
    pub attributes: u16,
    pub last_offset_delta: i32,
    pub base_timestamp: i64,
    pub max_timestamp: i64,
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
    pub record_count: i32,
}

impl BatchHeader {
    /// Reads the header at the start of `buf`; `buf` must hold at least [`HEADER_LEN`] bytes.
    /// Only the magic byte is checked here (a v0/v1 message set has a different layout past it).
    pub fn read(buf: &[u8]) -> Result<BatchHeader, Error> {
        let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
            return Err(Error::Batch {
                base_offset: buf
                    .first_chunk::<8>()
                    .map_or(-1, |b| i64::from_be_bytes(*b)),
                reason: format!("{} bytes, shorter than a batch header", buf.len()),
            });
        };
        let base_offset = i64::from_be_bytes(field(h, 0));
        let magic = h[16] as i8;
        if magic != 2 {
            return Err(Error::Magic { base_offset, magic });
        }
        Ok(BatchHeader {
            base_offset,
            batch_length: i32::from_be_bytes(field(h, 8)),
            partition_leader_epoch: i32::from_be_bytes(field(h, 12)),
            magic,
            crc: u32::from_be_bytes(field(h, 17)),
            attributes: u16::from_be_bytes(field(h, 21)),
            last_offset_delta: i32::from_be_bytes(field(h, 23)),
            base_timestamp: i64::from_be_bytes(field(h, 27)),
            max_timestamp: i64::from_be_bytes(field(h, 35)),
            producer_id: i64::from_be_bytes(field(h, 43)),
            producer_epoch: i16::from_be_bytes(field(h, 51)),
            base_sequence: i32::from_be_bytes(field(h, 53)),
            record_count: i32::from_be_bytes(field(h, 57)),
        })
    }

    pub fn codec(&self) -> Result<Codec, Error> {
        let bits = (self.attributes & ATTR_CODEC) as u8;
        Codec::from_bits(bits).ok_or(Error::Codec {
            base_offset: self.base_offset,
            codec: bits,
        })
    }

    pub fn is_control(&self) -> bool {
        self.attributes & ATTR_CONTROL != 0
    }

    pub fn is_transactional(&self) -> bool {
        self.attributes & ATTR_TRANSACTIONAL != 0
    }

    /// Whether the broker stamped the batch (`LogAppendTime`): every record's timestamp is then
    /// `max_timestamp`, whatever its delta says.
    pub fn log_append_time(&self) -> bool {
        self.attributes & ATTR_LOG_APPEND_TIME != 0
    }

    /// The offset of the batch's last record as written, which consumers resume after even if
    /// that record is gone.
    pub fn last_offset(&self) -> i64 {
        self.base_offset
            .saturating_add(i64::from(self.last_offset_delta))
    }
}

fn field<const N: usize>(h: &[u8; HEADER_LEN], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&h[at..at + N]);
    out
}

/// Writes `original`'s header as an empty control batch: no records, uncompressed, the control
/// attribute set; base offset, last offset delta, timestamps, producer fields and leader epoch
/// unchanged. What a batch whose every record was withheld becomes: clients continue after its
/// last offset as after any batch, and a client that reads no record from a whole response takes
/// a control batch as progress, where an empty data batch looks like a record too large to fetch
/// (librdkafka doubles its fetch size then reports `MSG_SIZE_TOO_LARGE`, and kcat exits on it).
/// No record in it means no marker either: `read_committed` clients find no commit or abort in it.
pub fn rewrite_empty(original: &[u8; HEADER_LEN], out: &mut Vec<u8>) -> Result<(), Error> {
    let start = out.len();
    rewrite(original, Codec::None, 0, &[], out)?;
    let batch = &mut out[start..];
    let attributes = u16::from_be_bytes([batch[21], batch[22]]) | ATTR_CONTROL;
    batch[21..23].copy_from_slice(&attributes.to_be_bytes());
    let crc = checksum(batch);
    batch[17..21].copy_from_slice(&crc.to_be_bytes());
    Ok(())
}

/// The CRC-32C Kafka stores in a v2 batch: over the bytes from `attributes` to the end.
pub fn checksum(batch: &[u8]) -> u32 {
    crc32c::crc32c(batch.get(CRC_START..).unwrap_or_default())
}

/// Writes a batch from `original`'s header with a new record count and records section
/// (`payload`, already compressed with `codec`), fixing `batchLength`, the attributes' codec
/// bits and the CRC. Everything else (base offset, last offset delta, timestamps, producer
/// fields, leader epoch, the other attribute bits) is copied unchanged.
pub fn rewrite(
    original: &[u8; HEADER_LEN],
    codec: Codec,
    record_count: i32,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    let start = out.len();
    let base_offset = i64::from_be_bytes(field(original, 0));
    let length = (HEADER_LEN - LOG_OVERHEAD)
        .checked_add(payload.len())
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| Error::Batch {
            base_offset,
            reason: format!("rewritten batch of {} bytes is too large", payload.len()),
        })?;
    out.extend_from_slice(original);
    out.extend_from_slice(payload);
    let batch = &mut out[start..];
    batch[8..12].copy_from_slice(&length.to_be_bytes());
    let attributes =
        (u16::from_be_bytes([batch[21], batch[22]]) & !ATTR_CODEC) | u16::from(codec.bits());
    batch[21..23].copy_from_slice(&attributes.to_be_bytes());
    batch[57..61].copy_from_slice(&record_count.to_be_bytes());
    let crc = checksum(batch);
    batch[17..21].copy_from_slice(&crc.to_be_bytes());
    Ok(())
}
