//! Kafka's zig-zag varints (protobuf style) as records use them, refusing overlong encodings.

/// Reads a zig-zag `varint` (at most 5 bytes, fits an `i32`) from the front of `buf`, advancing
/// it. `None` if the input ends first, runs longer than 5 bytes, or overflows 32 bits.
pub(crate) fn read_varint(buf: &mut &[u8]) -> Option<i32> {
    let raw = read_unsigned(buf, 5)?;
    let raw = u32::try_from(raw).ok()?;
    Some(((raw >> 1) as i32) ^ -((raw & 1) as i32))
}

/// Reads a zig-zag `varlong` (at most 10 bytes, fits an `i64`).
pub(crate) fn read_varlong(buf: &mut &[u8]) -> Option<i64> {
    let raw = read_unsigned(buf, 10)?;
    Some(((raw >> 1) as i64) ^ -((raw & 1) as i64))
}

fn read_unsigned(buf: &mut &[u8], max_bytes: usize) -> Option<u64> {
    let mut value: u64 = 0;
    for i in 0..max_bytes {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        let bits = u64::from(b & 0x7f);
        let shift = 7 * i as u32;
        // The 10th byte of a varlong may only carry the top bit of 64.
        if shift == 63 && bits > 1 {
            return None;
        }
        value |= bits << shift;
        if b & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Appends `v` as a zig-zag `varint`.
#[cfg(test)]
pub(crate) fn write_varint(out: &mut Vec<u8>, v: i32) {
    let mut raw = ((v << 1) ^ (v >> 31)) as u32;
    while raw >= 0x80 {
        out.push((raw as u8) | 0x80);
        raw >>= 7;
    }
    out.push(raw as u8);
}

/// Appends `v` as a zig-zag `varlong`.
#[cfg(test)]
pub(crate) fn write_varlong(out: &mut Vec<u8>, v: i64) {
    let mut raw = ((v << 1) ^ (v >> 63)) as u64;
    while raw >= 0x80 {
        out.push((raw as u8) | 0x80);
        raw >>= 7;
    }
    out.push(raw as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn varints_round_trip(v: i32, tail: Vec<u8>) {
            let mut out = Vec::new();
            write_varint(&mut out, v);
            out.extend_from_slice(&tail);
            let mut buf = &out[..];
            prop_assert_eq!(read_varint(&mut buf), Some(v));
            prop_assert_eq!(buf, &tail[..]);
        }

        #[test]
        fn varlongs_round_trip(v: i64, tail: Vec<u8>) {
            let mut out = Vec::new();
            write_varlong(&mut out, v);
            out.extend_from_slice(&tail);
            let mut buf = &out[..];
            prop_assert_eq!(read_varlong(&mut buf), Some(v));
            prop_assert_eq!(buf, &tail[..]);
        }
    }

    #[test]
    fn overlong_and_overflowing_varints_are_refused() {
        // Six continuation bytes: longer than any varint.
        assert_eq!(
            read_varint(&mut &[0x80u8, 0x80, 0x80, 0x80, 0x80, 0x01][..]),
            None
        );
        // Five bytes whose value needs more than 32 bits.
        assert_eq!(
            read_varint(&mut &[0xffu8, 0xff, 0xff, 0xff, 0x1f][..]),
            None
        );
        // A tenth byte carrying more than bit 63.
        let mut long = [0xffu8; 10];
        long[9] = 0x02;
        assert_eq!(read_varlong(&mut &long[..]), None);
        long[9] = 0x01;
        assert_eq!(read_varlong(&mut &long[..]), Some(i64::MIN));
        // Cut short.
        assert_eq!(read_varint(&mut &[0x80u8][..]), None);
        assert_eq!(read_varint(&mut &[][..]), None);
    }
}
