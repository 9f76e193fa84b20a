//! The records of a v2 batch (after decompression), walked without copying: each record is
//! checked completely (lengths, offsets, header layout) before anyone looks at it, so a
//! [`Record`] handed out is well-formed and its header iterator cannot fail.

use crate::Error;
use crate::batch::BatchHeader;
use crate::varint::{read_varint, read_varlong};

/// The fewest bytes a record takes: length, attributes, timestamp delta, offset delta, key
/// length, value length and header count, one byte each.
pub const MIN_RECORD_LEN: usize = 7;

/// One record of a batch, borrowed from the decompressed records section.
#[derive(Debug, Clone)]
pub struct Record<'a> {
    /// Position in the batch, from 0.
    pub index: usize,
    /// Absolute offset: the batch's base offset plus the record's delta.
    pub offset: i64,
    /// Create time (base timestamp plus delta), or the batch's max timestamp for batches the
    /// broker stamped (`LogAppendTime`), as consumers see it.
    pub timestamp: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    /// The record as written, its length prefix included: what a rewritten batch copies.
    pub raw: &'a [u8],
    /// Where `raw` sits in the records section.
    pub span: std::ops::Range<usize>,
    headers: &'a [u8],
    header_count: usize,
}

impl<'a> Record<'a> {
    /// The record's headers in order, duplicates included (Kafka allows repeated keys).
    pub fn headers(&self) -> Headers<'a> {
        Headers {
            rest: self.headers,
            left: self.header_count,
        }
    }
}

/// Iterator over a [`Record`]'s headers: `(key, value)`, a null value as `None`.
#[derive(Debug, Clone)]
pub struct Headers<'a> {
    rest: &'a [u8],
    left: usize,
}

impl<'a> Iterator for Headers<'a> {
    type Item = (&'a [u8], Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // The walk validated this layout; a failure here would only end the iteration early.
        let key = read_bytes(&mut self.rest)??;
        let value = read_bytes(&mut self.rest)?;
        Some((key, value))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// Reads a varint-length-prefixed byte string: `Some(None)` (null) for a negative length, `None`
/// for one past the end. Any negative length is null because the Java client reads keys, values
/// and header values so (`DefaultRecord.readFrom`): a record it delivers must not be one the relay
/// refuses, which would close the consumer's connection at the same offset again and again.
fn read_bytes<'a>(buf: &mut &'a [u8]) -> Option<Option<&'a [u8]>> {
    let len = read_varint(buf)?;
    if len < 0 {
        return Some(None);
    }
    let len = usize::try_from(len).ok()?;
    if len > buf.len() {
        return None;
    }
    let (bytes, rest) = buf.split_at(len);
    *buf = rest;
    Some(Some(bytes))
}

/// Walks every record of `section` (the batch's records, decompressed), calling `each` in
/// order. Refuses anything a strict reader could read two ways: a count that does not match,
/// bytes after the last record, a record whose fields do not fill its declared length, offset
/// deltas that do not increase or pass the batch's last offset delta.
pub fn walk<'a>(
    header: &BatchHeader,
    section: &'a [u8],
    mut each: impl FnMut(Record<'a>),
) -> Result<(), Error> {
    let bad = |index: usize, reason: String| Error::Record {
        base_offset: header.base_offset,
        index,
        reason,
    };
    let count = usize::try_from(header.record_count)
        .map_err(|_| bad(0, format!("negative record count {}", header.record_count)))?;
    if count > section.len() / MIN_RECORD_LEN {
        return Err(bad(
            0,
            format!(
                "record count {count} cannot fit in {} bytes of records",
                section.len()
            ),
        ));
    }
    let mut rest = section;
    let mut last_delta: Option<i32> = None;
    for index in 0..count {
        let start = rest;
        let len = read_varint(&mut rest).ok_or_else(|| bad(index, "bad length varint".into()))?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= rest.len())
            .ok_or_else(|| {
                bad(
                    index,
                    format!("length {len} with {} bytes left", rest.len()),
                )
            })?;
        let prefix = start.len() - rest.len();
        let raw = &start[..prefix + len];
        let from = section.len() - start.len();
        let span = from..from + raw.len();
        let (mut body, after) = rest.split_at(len);
        rest = after;

        let truncated = || bad(index, "fields run past the record's length".into());
        let (_attributes, tail) = body.split_first().ok_or_else(truncated)?;
        body = tail;
        let ts_delta = read_varlong(&mut body).ok_or_else(truncated)?;
        let offset_delta = read_varint(&mut body).ok_or_else(truncated)?;
        if offset_delta < 0
            || offset_delta > header.last_offset_delta
            || last_delta.is_some_and(|l| offset_delta <= l)
        {
            return Err(bad(
                index,
                format!(
                    "offset delta {offset_delta} out of order (previous {last_delta:?}, last offset delta {})",
                    header.last_offset_delta
                ),
            ));
        }
        last_delta = Some(offset_delta);
        let key = read_bytes(&mut body).ok_or_else(truncated)?;
        let value = read_bytes(&mut body).ok_or_else(truncated)?;
        let header_count = read_varint(&mut body).ok_or_else(truncated)?;
        let header_count = usize::try_from(header_count)
            .map_err(|_| bad(index, format!("negative header count {header_count}")))?;
        let headers = body;
        for _ in 0..header_count {
            match read_bytes(&mut body) {
                Some(Some(_)) => {}
                // The Java client refuses these too ("Invalid negative header key size").
                Some(None) => return Err(bad(index, "header with a null key".into())),
                None => return Err(truncated()),
            }
            read_bytes(&mut body).ok_or_else(truncated)?;
        }
        if !body.is_empty() {
            return Err(bad(
                index,
                format!("{} bytes after the last header", body.len()),
            ));
        }
        let timestamp = if header.log_append_time() {
            header.max_timestamp
        } else {
            header.base_timestamp.saturating_add(ts_delta)
        };
        each(Record {
            index,
            offset: header.base_offset.saturating_add(i64::from(offset_delta)),
            timestamp,
            key,
            value,
            raw,
            span,
            headers,
            header_count,
        });
    }
    if !rest.is_empty() {
        return Err(bad(
            count,
            format!("{} bytes after the last of {count} records", rest.len()),
        ));
    }
    Ok(())
}
