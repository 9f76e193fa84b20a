//! Kafka's framing: a 4-byte big-endian size, then that many bytes (request or response).

use bytes::{Buf, Bytes, BytesMut};

use crate::Error;

/// Largest frame accepted by default: the broker's own `socket.request.max.bytes` default.
pub const DEFAULT_MAX_FRAME: usize = 100 << 20;

/// Takes one whole frame (without its size) off the front of `buf`; `None` until all of it has
/// arrived. A negative size or one above `max` is an error: nothing after it can be framed.
pub fn split_frame(buf: &mut BytesMut, max: usize) -> Result<Option<Bytes>, Error> {
    let Some(size) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let size = i32::from_be_bytes(*size);
    let len = usize::try_from(size)
        .ok()
        .filter(|&l| l <= max)
        .ok_or(Error::Frame {
            reason: format!("frame size {size} (limit {max})"),
        })?;
    if buf.len() < 4 + len {
        buf.reserve(4 + len - buf.len());
        return Ok(None);
    }
    buf.advance(4);
    Ok(Some(buf.split_to(len).freeze()))
}

/// Appends `frame` with its size.
pub fn put_frame(out: &mut BytesMut, frame: &[u8]) -> Result<(), Error> {
    let size = i32::try_from(frame.len()).map_err(|_| Error::Frame {
        reason: format!("frame of {} bytes is too large to send", frame.len()),
    })?;
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(frame);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_only_when_whole() {
        let mut buf = BytesMut::new();
        put_frame(&mut buf, b"hello").unwrap();
        put_frame(&mut buf, b"").unwrap();
        let whole = buf.clone();
        let mut partial = BytesMut::from(&whole[..6]);
        assert_eq!(split_frame(&mut partial, 10).unwrap(), None);
        assert_eq!(split_frame(&mut buf, 10).unwrap().unwrap(), &b"hello"[..]);
        assert_eq!(split_frame(&mut buf, 10).unwrap().unwrap(), &b""[..]);
        assert_eq!(split_frame(&mut buf, 10).unwrap(), None);
        let mut big = BytesMut::from(&[0u8, 0, 0, 11][..]);
        assert!(split_frame(&mut big, 10).is_err());
        let mut negative = BytesMut::from(&[0xffu8, 0xff, 0xff, 0xff][..]);
        assert!(split_frame(&mut negative, 10).is_err());
    }
}
