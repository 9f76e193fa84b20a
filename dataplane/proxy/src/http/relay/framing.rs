//! Response body framing (RFC 9112 §6.3), followed as the body passes through.

/// How a response body ends (RFC 9112 §6.3).
pub(super) enum Framing {
    Empty,
    Fixed(u64),
    Chunked(Chunked),
    UntilClose,
}

impl Framing {
    /// How many bytes at the start of `data` belong to the body, and whether it is then complete.
    pub(super) fn take(&mut self, data: &[u8]) -> Result<(usize, bool), ()> {
        match self {
            Framing::Empty => Ok((0, true)),
            Framing::Fixed(left) => {
                let n = (*left).min(data.len() as u64);
                *left -= n;
                Ok((n as usize, *left == 0))
            }
            Framing::Chunked(c) => c.feed(data),
            Framing::UntilClose => Ok((data.len(), false)),
        }
    }
}

/// Follows a chunked body (RFC 9112 §7.1) as it passes through, without decoding it: sizes
/// must be hex that fits in 60 bits, every line must end in CRLF, extension and trailer lines
/// are bounded.
#[derive(Default)]
pub(super) struct Chunked {
    state: ChunkState,
    size: u64,
    /// Bytes of the current size line's extension, or of the trailer section so far.
    line: usize,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    SizeDigits,
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    Trailer,
    TrailerLf {
        empty: bool,
    },
    TrailerStart,
    Done,
}

/// Longest chunk extension, and largest trailer section, accepted.
const MAX_CHUNK_LINE: usize = 4096;

impl Chunked {
    fn feed(&mut self, data: &[u8]) -> Result<(usize, bool), ()> {
        use ChunkState::*;
        let mut i = 0;
        while i < data.len() {
            match self.state {
                Done => break,
                Data => {
                    let n = self.size.min((data.len() - i) as u64);
                    i += n as usize;
                    self.size -= n;
                    if self.size == 0 {
                        self.state = DataCr;
                    }
                    continue;
                }
                _ => {}
            }
            let b = data[i];
            i += 1;
            self.state = match (self.state, b) {
                (Size | SizeDigits, b) if b.is_ascii_hexdigit() => {
                    if self.size >> 56 != 0 {
                        return Err(());
                    }
                    let d = (b as char).to_digit(16).ok_or(())?;
                    self.size = self.size * 16 + u64::from(d);
                    SizeDigits
                }
                (SizeDigits, b';' | b' ' | b'\t') => {
                    self.line = 0;
                    Ext
                }
                (SizeDigits | Ext, b'\r') => SizeLf,
                (Ext, b) if b == b'\t' || (b >= 0x20 && b != 0x7f) => {
                    self.line += 1;
                    if self.line > MAX_CHUNK_LINE {
                        return Err(());
                    }
                    Ext
                }
                (SizeLf, b'\n') if self.size == 0 => {
                    self.line = 0;
                    TrailerStart
                }
                (SizeLf, b'\n') => Data,
                (DataCr, b'\r') => DataLf,
                (DataLf, b'\n') => Size,
                (TrailerStart, b'\r') => TrailerLf { empty: true },
                (Trailer, b'\r') => TrailerLf { empty: false },
                (TrailerStart | Trailer, b) if b == b'\t' || (b >= 0x20 && b != 0x7f) => {
                    self.line += 1;
                    if self.line > MAX_CHUNK_LINE {
                        return Err(());
                    }
                    Trailer
                }
                (TrailerLf { empty: true }, b'\n') => Done,
                (TrailerLf { empty: false }, b'\n') => TrailerStart,
                _ => return Err(()),
            };
        }
        Ok((i, self.state == Done))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `body` to a fresh follower in pieces of `step` bytes.
    fn follow(body: &[u8], step: usize) -> Result<(usize, bool), ()> {
        let mut c = Chunked::default();
        let mut at = 0;
        while at < body.len() {
            let piece = &body[at..(at + step).min(body.len())];
            let (n, done) = c.feed(piece)?;
            at += n;
            if done {
                return Ok((at, true));
            }
            assert_eq!(n, piece.len(), "an unfinished body takes every byte");
        }
        Ok((at, false))
    }

    #[test]
    fn chunked_bodies_are_followed_to_their_end_however_they_arrive() {
        let good: [&[u8]; 4] = [
            b"0\r\n\r\n",
            b"3\r\nabc\r\n0\r\n\r\n",
            b"A;name=v\r\n0123456789\r\n10\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n",
            b"1 ;x\r\na\r\n0\r\n\r\n",
        ];
        for body in good {
            for step in 1..=body.len() {
                let mut next = body.to_vec();
                next.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
                assert_eq!(
                    follow(&next, step),
                    Ok((body.len(), true)),
                    "{body:?} step {step}"
                );
            }
        }
        let bad: [&[u8]; 8] = [
            b"x\r\n",
            b"\r\n",
            b"3\nabc\r\n0\r\n\r\n",
            b"3\r\nabcd\r\n",
            b"3\r\nabc\n0\r\n\r\n",
            b"10000000000000000\r\n",
            b"0\r\nX: 1\n\r\n",
            b"-1\r\n",
        ];
        for body in bad {
            assert_eq!(follow(body, body.len()), Err(()), "{body:?}");
        }
        assert_eq!(follow(b"5\r\nab", 2), Ok((5, false)));
    }

    #[test]
    fn framing_takes_only_its_own_bytes() {
        let mut f = Framing::Fixed(3);
        assert_eq!(f.take(b"ab"), Ok((2, false)));
        assert_eq!(f.take(b"cdef"), Ok((1, true)));
        assert_eq!(Framing::Empty.take(b"xyz"), Ok((0, true)));
        assert_eq!(Framing::UntilClose.take(b"xyz"), Ok((3, false)));
    }
}
