//! The four codecs a v2 record batch may use, with decompression bounded by a byte limit: a
//! batch is attacker-sized input (a broker's bytes, or a producer's relayed by a broker), and a
//! few kilobytes of gzip or zstd can expand to gigabytes.
//!
//! Each codec comes from a pure-Rust crate (flate2, snap, lz4_flex, ruzstd); only Kafka's
//! framing around snappy blocks (xerial's, as the Java client writes it) is written here.

use std::fmt;
use std::io::Read;

/// A batch's compression codec: attribute bits 0-2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    None,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
}

impl Codec {
    /// Every codec, in attribute order.
    pub const ALL: [Codec; 5] = [
        Codec::None,
        Codec::Gzip,
        Codec::Snappy,
        Codec::Lz4,
        Codec::Zstd,
    ];

    /// The codec of attribute bits 0-2; `None` for 5-7, which Kafka does not define.
    pub fn from_bits(bits: u8) -> Option<Codec> {
        Codec::ALL.get(usize::from(bits)).copied()
    }

    pub fn bits(self) -> u8 {
        self as u8
    }

    /// The name Kafka's `compression.type` uses.
    pub fn name(self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Gzip => "gzip",
            Codec::Snappy => "snappy",
            Codec::Lz4 => "lz4",
            Codec::Zstd => "zstd",
        }
    }
}

/// The same codecs as the `kafka-protocol` crate names them (its record encoder and decoder).
impl From<kafka_protocol::records::Compression> for Codec {
    fn from(c: kafka_protocol::records::Compression) -> Codec {
        use kafka_protocol::records::Compression as C;
        match c {
            C::None => Codec::None,
            C::Gzip => Codec::Gzip,
            C::Snappy => Codec::Snappy,
            C::Lz4 => Codec::Lz4,
            C::Zstd => Codec::Zstd,
        }
    }
}

impl From<Codec> for kafka_protocol::records::Compression {
    fn from(c: Codec) -> Self {
        use kafka_protocol::records::Compression as C;
        match c {
            Codec::None => C::None,
            Codec::Gzip => C::Gzip,
            Codec::Snappy => C::Snappy,
            Codec::Lz4 => C::Lz4,
            Codec::Zstd => C::Zstd,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// xerial snappy-java's stream header: magic, then version 1 and compatible version 1.
const XERIAL_HEADER: &[u8; 16] = b"\x82SNAPPY\x00\x00\x00\x00\x01\x00\x00\x00\x01";
/// The magic alone: a stream that starts with it is framed, whatever versions follow.
const XERIAL_MAGIC: &[u8; 8] = b"\x82SNAPPY\x00";
/// Block size of snappy-java's output stream, which Kafka's Java producer uses.
const XERIAL_BLOCK: usize = 32 * 1024;

/// The window every zstd decoder must support (RFC 8878 recommends 8 MiB).
const ZSTD_MIN_WINDOW: usize = 8 << 20;

/// Decompresses `input` into at most `limit` bytes; more is an error, never a larger allocation.
pub fn decompress(codec: Codec, input: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    match codec {
        Codec::None => bounded(input.len(), limit).map(|()| input.to_vec()),
        Codec::Gzip => read_bounded(flate2::read::MultiGzDecoder::new(input), limit),
        Codec::Snappy => snappy_decompress(input, limit),
        Codec::Lz4 => read_bounded(lz4_flex::frame::FrameDecoder::new(input), limit),
        Codec::Zstd => zstd_decompress(input, limit),
    }
}

/// Compresses `input` as Kafka's clients do (gzip level 6, xerial-framed snappy, an LZ4 frame
/// of independent 64 KiB blocks, zstd at its fastest level).
pub fn compress(codec: Codec, input: &[u8]) -> Result<Vec<u8>, String> {
    use std::io::Write;
    match codec {
        Codec::None => Ok(input.to_vec()),
        Codec::Gzip => {
            let mut enc = flate2::write::GzEncoder::new(
                Vec::with_capacity(input.len() / 2),
                flate2::Compression::default(),
            );
            enc.write_all(input).map_err(|e| e.to_string())?;
            enc.finish().map_err(|e| e.to_string())
        }
        Codec::Snappy => {
            let mut out = Vec::with_capacity(XERIAL_HEADER.len() + input.len() / 2);
            out.extend_from_slice(XERIAL_HEADER);
            let mut enc = snap::raw::Encoder::new();
            for block in input.chunks(XERIAL_BLOCK) {
                let compressed = enc.compress_vec(block).map_err(|e| e.to_string())?;
                let len = u32::try_from(compressed.len()).map_err(|e| e.to_string())?;
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&compressed);
            }
            Ok(out)
        }
        Codec::Lz4 => {
            let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(input.len() / 2));
            enc.write_all(input).map_err(|e| e.to_string())?;
            enc.finish().map_err(|e| e.to_string())
        }
        Codec::Zstd => Ok(ruzstd::encoding::compress_to_vec(
            input,
            ruzstd::encoding::CompressionLevel::Fastest,
        )),
    }
}

fn bounded(len: usize, limit: usize) -> Result<(), String> {
    if len > limit {
        Err(format!(
            "decompresses to more than the limit of {limit} bytes"
        ))
    } else {
        Ok(())
    }
}

/// Reads a decoder to its end, refusing output beyond `limit` after reading one byte too many.
fn read_bounded(reader: impl Read, limit: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    reader
        .take(cap)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    bounded(out.len(), limit)?;
    Ok(out)
}

/// Snappy as Kafka's clients write it: xerial-framed (`[u32 length][raw block]`* after a 16-byte
/// header; the Java client) or one raw block (librdkafka's default before xerial framing).
fn snappy_decompress(input: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    let mut dec = snap::raw::Decoder::new();
    let Some(mut rest) = input.strip_prefix(XERIAL_MAGIC.as_slice()) else {
        let len = snap::raw::decompress_len(input).map_err(|e| e.to_string())?;
        bounded(len, limit)?;
        return dec.decompress_vec(input).map_err(|e| e.to_string());
    };
    // Version and compatible version: snappy-java reads and ignores them.
    rest = rest
        .get(8..)
        .ok_or_else(|| "xerial header cut short".to_string())?;
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| "xerial block length cut short".to_string())?;
        let len = usize::try_from(u32::from_be_bytes(*len)).map_err(|e| e.to_string())?;
        if len > tail.len() {
            return Err(format!(
                "xerial block of {len} bytes with {} left",
                tail.len()
            ));
        }
        let (block, tail) = tail.split_at(len);
        let n = snap::raw::decompress_len(block).map_err(|e| e.to_string())?;
        bounded(out.len().saturating_add(n), limit)?;
        let start = out.len();
        out.resize(start + n, 0);
        let written = dec
            .decompress(block, &mut out[start..])
            .map_err(|e| e.to_string())?;
        out.truncate(start + written);
        rest = tail;
    }
    Ok(out)
}

/// One or more zstd frames (zstd-jni's stream reads concatenated frames too). A frame's window
/// (the history the decoder keeps) may not exceed `limit` or 8 MiB, whichever is larger: zstd
/// levels up to 19 use at most 8 MiB, and a frame header must not make the decoder reserve more.
fn zstd_decompress(input: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut source = input;
    let window = u64::try_from(limit.max(ZSTD_MIN_WINDOW)).unwrap_or(u64::MAX);
    while !source.is_empty() {
        let dec = ruzstd::decoding::StreamingDecoder::new_with_max_window_size(&mut source, window)
            .map_err(|e| e.to_string())?;
        let budget = limit - out.len();
        let frame = read_bounded(dec, budget).map_err(|e| {
            if e.starts_with("decompresses to more") {
                format!("decompresses to more than the limit of {limit} bytes")
            } else {
                e
            }
        })?;
        out.extend_from_slice(&frame);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..200_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect()
    }

    #[test]
    fn every_codec_round_trips_and_respects_the_limit() {
        let data = sample();
        for codec in Codec::ALL {
            let packed = compress(codec, &data).unwrap();
            assert_eq!(
                decompress(codec, &packed, data.len()).unwrap(),
                data,
                "{codec}"
            );
            let err = decompress(codec, &packed, data.len() - 1).unwrap_err();
            assert!(err.contains("more than the limit"), "{codec}: {err}");
            // Empty input: an error or nothing, never a panic.
            let _ = decompress(codec, &[], 10);
        }
    }

    #[test]
    fn a_small_bomb_is_refused_before_it_expands() {
        let zeros = vec![0u8; 8 << 20];
        for codec in [Codec::Gzip, Codec::Snappy, Codec::Lz4, Codec::Zstd] {
            let packed = compress(codec, &zeros).unwrap();
            assert!(packed.len() < 1 << 20, "{codec}: {}", packed.len());
            let err = decompress(codec, &packed, 1 << 20).unwrap_err();
            assert!(err.contains("more than the limit"), "{codec}: {err}");
        }
    }

    #[test]
    fn raw_snappy_is_read_as_librdkafka_writes_it() {
        let data = sample();
        let raw = snap::raw::Encoder::new().compress_vec(&data).unwrap();
        assert_eq!(decompress(Codec::Snappy, &raw, data.len()).unwrap(), data);
        assert!(decompress(Codec::Snappy, &raw, 10).is_err());
    }

    #[test]
    fn truncated_payloads_are_errors() {
        let data = sample();
        for codec in [Codec::Gzip, Codec::Snappy, Codec::Lz4, Codec::Zstd] {
            let packed = compress(codec, &data).unwrap();
            let cut = &packed[..packed.len() / 2];
            assert!(decompress(codec, cut, data.len()).is_err(), "{codec}");
        }
    }
}
