//! Filtering a partition's records, as a Fetch response carries them, by a per-record decision.
//!
//! What a consumer must still be able to do with the result, and how it is kept:
//! - **resume after the batch**: clients continue at `baseOffset + lastOffsetDelta + 1` of the
//!   last batch they read, so a rewritten batch keeps its header's base offset and last offset
//!   delta even when its last records are gone, and a batch left with no records is still
//!   written, empty and marked as a control batch (`batch::rewrite_empty`: librdkafka takes a
//!   response whose batches hold no record and no control batch for a record too large to fetch;
//!   every client skips a control batch and continues after it);
//! - **read each kept record as written**: kept records are copied byte for byte; their offset
//!   and timestamp deltas stay right because the base offset and base timestamp stay;
//! - **trust the batch**: the CRC-32C is checked before anything is read and recomputed after a
//!   rewrite; the records are recompressed with the batch's codec (an empty batch is written
//!   uncompressed, so no client has to decompress nothing);
//! - **transactions**: control batches (commit and abort markers) and the producer fields that
//!   `read_committed` consumers match aborted transactions by pass through unchanged (an emptied
//!   batch keeps them too, and holds no marker).
//!
//! A batch the filter keeps whole is passed on as the same bytes; a response nothing is dropped
//! from is passed on without a copy. A batch cut off at the end of the response (brokers may send
//! one when the fetch size ends inside it) is left out: clients discard it anyway and fetch it
//! again from its first offset.

use bytes::Bytes;

use crate::Error;
use crate::batch::{self, BatchHeader, HEADER_LEN, LOG_OVERHEAD};
use crate::codec::{self, Codec};
use crate::records::{self, Record};

/// Bounds on the work one batch may cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest decompressed records section of one batch. A larger batch fails the response
    /// (the connection is closed), because passing it on unfiltered could hand a record to the
    /// wrong consumer. Kafka's default `max.message.bytes` is 1 MiB compressed.
    pub max_batch_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_batch_bytes: 32 << 20,
        }
    }
}

/// What a filtering pass did; the sidecar sums these into its metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Complete batches read, control batches included.
    pub batches: u64,
    pub control_batches: u64,
    pub records_kept: u64,
    pub records_dropped: u64,
    /// Batches written anew because records were dropped from them.
    pub batches_rewritten: u64,
    /// Of those, batches left with no records.
    pub batches_emptied: u64,
    /// Bytes of the rewritten batches as written.
    pub bytes_rewritten: u64,
    /// Bytes of a batch cut off at the end of the response, left out.
    pub partial_tail_bytes: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.batches += o.batches;
        self.control_batches += o.control_batches;
        self.records_kept += o.records_kept;
        self.records_dropped += o.records_dropped;
        self.batches_rewritten += o.batches_rewritten;
        self.batches_emptied += o.batches_emptied;
        self.bytes_rewritten += o.bytes_rewritten;
        self.partial_tail_bytes += o.partial_tail_bytes;
    }
}

/// The records to send on, and what it took.
#[derive(Debug, Clone)]
pub struct Filtered {
    pub records: Bytes,
    pub stats: Stats,
}

/// Filters `records` (one partition's `records` field of a Fetch response: v2 batches back to
/// back) keeping the records for which `keep` returns `true`. `keep` sees the batch header (for
/// its producer and transaction fields) and each record; it is not called for control batches.
///
/// Errors on anything that is not a well-formed v2 batch (the caller drops the connection; no
/// record is ever passed on unchecked).
pub fn filter(
    records: &Bytes,
    limits: &Limits,
    mut keep: impl FnMut(&BatchHeader, &Record<'_>) -> bool,
) -> Result<Filtered, Error> {
    let input: &[u8] = records;
    let mut stats = Stats::default();
    // Written only once a batch changes: until then the output is a prefix of the input.
    let mut out: Option<Vec<u8>> = None;
    let mut pos = 0;
    let mut kept_ranges: Vec<(usize, usize)> = Vec::new();
    let mut section = Vec::new();
    while pos < input.len() {
        let rest = &input[pos..];
        let Some(len) = whole_batch_len(rest)? else {
            stats.partial_tail_bytes = rest.len() as u64;
            break;
        };
        let bytes = &rest[..len];
        let header = BatchHeader::read(bytes)?;
        let computed = batch::checksum(bytes);
        if computed != header.crc {
            return Err(Error::Crc {
                base_offset: header.base_offset,
                stored: header.crc,
                computed,
            });
        }
        stats.batches += 1;
        if header.is_control() {
            stats.control_batches += 1;
            if let Some(out) = &mut out {
                out.extend_from_slice(bytes);
            }
            pos += len;
            continue;
        }
        let codec = header.codec()?;
        let payload = &bytes[HEADER_LEN..];
        let decompressed;
        let body: &[u8] = if codec == Codec::None {
            payload
        } else {
            decompressed =
                codec::decompress(codec, payload, limits.max_batch_bytes).map_err(|reason| {
                    Error::Decompress {
                        base_offset: header.base_offset,
                        codec: codec.name(),
                        reason,
                    }
                })?;
            &decompressed
        };
        if codec == Codec::None && body.len() > limits.max_batch_bytes {
            return Err(Error::Decompress {
                base_offset: header.base_offset,
                codec: codec.name(),
                reason: format!(
                    "{} bytes of records, more than the limit of {} bytes",
                    body.len(),
                    limits.max_batch_bytes
                ),
            });
        }
        kept_ranges.clear();
        let mut dropped = 0u64;
        records::walk(&header, body, |r| {
            if keep(&header, &r) {
                match kept_ranges.last_mut() {
                    Some((_, end)) if *end == r.span.start => *end = r.span.end,
                    _ => kept_ranges.push((r.span.start, r.span.end)),
                }
            } else {
                dropped += 1;
            }
        })?;
        // `walk` checked that the count is the number of records it read.
        let count = u64::try_from(header.record_count).unwrap_or(0);
        stats.records_kept += count - dropped;
        stats.records_dropped += dropped;
        if dropped == 0 {
            if let Some(out) = &mut out {
                out.extend_from_slice(bytes);
            }
            pos += len;
            continue;
        }
        let out = out.get_or_insert_with(|| {
            let mut v = Vec::with_capacity(input.len());
            v.extend_from_slice(&input[..pos]);
            v
        });
        let before = out.len();
        let Some(original) = bytes.first_chunk::<HEADER_LEN>() else {
            // `whole_batch_len` only returns lengths of at least a header.
            return Err(Error::Batch {
                base_offset: header.base_offset,
                reason: "batch shorter than its header".into(),
            });
        };
        let kept = count - dropped;
        let new_count = i32::try_from(kept).unwrap_or(i32::MAX);
        if kept == 0 {
            batch::rewrite_empty(original, out)?;
            stats.batches_emptied += 1;
        } else {
            section.clear();
            for &(s, e) in &kept_ranges {
                section.extend_from_slice(&body[s..e]);
            }
            // Uncompressed, the kept records are the payload: no second copy.
            let compressed;
            let payload: &[u8] = if codec == Codec::None {
                &section
            } else {
                compressed =
                    codec::compress(codec, &section).map_err(|reason| Error::Compress {
                        base_offset: header.base_offset,
                        codec: codec.name(),
                        reason,
                    })?;
                &compressed
            };
            batch::rewrite(original, codec, new_count, payload, out)?;
        }
        stats.batches_rewritten += 1;
        stats.bytes_rewritten += (out.len() - before) as u64;
        pos += len;
    }
    let records = match out {
        Some(v) => Bytes::from(v),
        None => records.slice(..pos),
    };
    Ok(Filtered { records, stats })
}

/// The length of the batch at the start of `rest` if all of it is there; `None` if it is cut
/// off (a partial batch at the end of a response). A length that cannot hold a batch header is
/// an error, not a partial batch: no broker writes one.
fn whole_batch_len(rest: &[u8]) -> Result<Option<usize>, Error> {
    let Some(head) = rest.first_chunk::<LOG_OVERHEAD>() else {
        return Ok(None);
    };
    let mut offset = [0u8; 8];
    offset.copy_from_slice(&head[..8]);
    let base_offset = i64::from_be_bytes(offset);
    let length = i32::from_be_bytes([head[8], head[9], head[10], head[11]]);
    let length = usize::try_from(length)
        .ok()
        .filter(|&l| l >= HEADER_LEN - LOG_OVERHEAD)
        .ok_or_else(|| Error::Batch {
            base_offset,
            reason: format!("batch length {length} is shorter than a batch header"),
        })?;
    let total = LOG_OVERHEAD + length;
    Ok((total <= rest.len()).then_some(total))
}
