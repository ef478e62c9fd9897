//! Byte streams of unknown length carried over a [`Transport`] as
//! length-prefixed chunks, and the status answer that ends each step of
//! the server-to-server and operator streams (a migration's intake, a
//! snapshot copied off or onto a server). The reader learns where a stream
//! ends from the framing, never from lengths inside what it carries.

use std::io::{self, Read, Write};

use crate::Transport;

/// Largest chunk on the wire.
pub const CHUNK: usize = 1 << 20;
/// Longest reason an answer carries.
pub const MAX_REASON: usize = 1024;

/// A byte stream written as length-prefixed chunks (u32 LE length, then
/// the bytes); [`ChunkWriter::finish`] writes the empty chunk that ends it.
pub struct ChunkWriter<'a, T: Transport + ?Sized> {
    t: &'a mut T,
    buf: Vec<u8>,
    pub sent: u64,
}

impl<'a, T: Transport + ?Sized> ChunkWriter<'a, T> {
    pub fn new(t: &'a mut T) -> Self {
        ChunkWriter { t, buf: Vec::with_capacity(CHUNK), sent: 0 }
    }

    fn send(&mut self, bytes_from_buf: bool, direct: &[u8]) -> io::Result<()> {
        let data: &[u8] = if bytes_from_buf { &self.buf } else { direct };
        if data.is_empty() {
            return Ok(());
        }
        let len = (data.len() as u32).to_le_bytes();
        self.t.send(&[&len, data])?;
        self.sent += data.len() as u64;
        if bytes_from_buf {
            self.buf.clear();
        }
        Ok(())
    }

    /// Sends what is buffered and the end of the stream.
    pub fn finish(mut self) -> io::Result<u64> {
        self.send(true, &[])?;
        self.t.send(&[&0u32.to_le_bytes()])?;
        Ok(self.sent)
    }
}

impl<T: Transport + ?Sized> Write for ChunkWriter<'_, T> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.is_empty() && data.len() >= CHUNK {
            // Large parts (device memory) go out without a copy.
            self.send(false, &data[..CHUNK])?;
            return Ok(CHUNK);
        }
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.send(true, &[])?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send(true, &[])
    }
}

/// Reads what a [`ChunkWriter`] wrote: end of file at the empty chunk; a
/// chunk longer than [`CHUNK`] is invalid data; a stream cut before its
/// end is `UnexpectedEof`.
pub struct ChunkReader<'a, T: Transport + ?Sized> {
    t: &'a mut T,
    left: usize,
    done: bool,
    pub received: u64,
}

impl<'a, T: Transport + ?Sized> ChunkReader<'a, T> {
    pub fn new(t: &'a mut T) -> Self {
        ChunkReader { t, left: 0, done: false, received: 0 }
    }

    /// Whether the end of the stream was read.
    pub fn ended(&mut self) -> io::Result<bool> {
        let mut b = [0u8; 1];
        Ok(self.done || self.read(&mut b)? == 0)
    }
}

impl<T: Transport + ?Sized> Read for ChunkReader<'_, T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut len = [0u8; 4];
            self.t.recv_exact(&mut len)?;
            let n = u32::from_le_bytes(len) as usize;
            if n == 0 {
                self.done = true;
                return Ok(0);
            }
            if n > CHUNK {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a chunk of {n} bytes (at most {CHUNK})")));
            }
            self.left = n;
        }
        let k = buf.len().min(self.left);
        self.t.recv_exact(&mut buf[..k])?;
        self.left -= k;
        self.received += k as u64;
        Ok(k)
    }
}

/// An answer on a server-to-server or operator stream: status (0 ok), a
/// reason (u32 length, then text, empty when ok) and two u64 whose meaning
/// is the stream's (a migration's target: the snapshot bytes and device
/// memory it rebuilt).
pub fn answer<T: Transport + ?Sized>(t: &mut T, status: u32, reason: &str, bytes: u64, memory: u64) -> io::Result<()> {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON)];
    t.send(&[&status.to_le_bytes(), &(reason.len() as u32).to_le_bytes(), reason, &bytes.to_le_bytes(), &memory.to_le_bytes()])
}

pub fn read_answer<T: Transport + ?Sized>(t: &mut T) -> io::Result<Result<(u64, u64), String>> {
    let mut head = [0u8; 8];
    t.recv_exact(&mut head)?;
    let status = u32::from_le_bytes(head[..4].try_into().unwrap_or_default());
    let len = u32::from_le_bytes(head[4..].try_into().unwrap_or_default()) as usize;
    if len > MAX_REASON {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "an over-long reason"));
    }
    let mut reason = vec![0u8; len];
    t.recv_exact(&mut reason)?;
    let mut tail = [0u8; 16];
    t.recv_exact(&mut tail)?;
    if status != 0 {
        return Ok(Err(String::from_utf8_lossy(&reason).into_owned()));
    }
    let bytes = u64::from_le_bytes(tail[..8].try_into().unwrap_or_default());
    let memory = u64::from_le_bytes(tail[8..].try_into().unwrap_or_default());
    Ok(Ok((bytes, memory)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One end of an in-memory stream.
    struct Pipe {
        out: Vec<u8>,
        input: io::Cursor<Vec<u8>>,
    }

    impl Transport for Pipe {
        fn send(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
            for b in bufs {
                self.out.extend_from_slice(b);
            }
            Ok(())
        }
        fn recv_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
            self.input.read_exact(buf)
        }
        fn peer(&self) -> &str {
            "pipe"
        }
        fn shutdown(&self) {}
    }

    fn pipe(input: Vec<u8>) -> Pipe {
        Pipe { out: Vec::new(), input: io::Cursor::new(input) }
    }

    #[test]
    fn chunks_carry_a_stream_whole_and_say_where_it_ends() {
        let data: Vec<u8> = (0..(3 * CHUNK + 12345)).map(|i| (i * 7 % 251) as u8).collect();
        let mut a = pipe(Vec::new());
        let mut w = ChunkWriter::new(&mut a);
        w.write_all(&data[..10]).unwrap();
        w.write_all(&data[10..2 * CHUNK + 5]).unwrap();
        w.write_all(&data[2 * CHUNK + 5..]).unwrap();
        assert_eq!(w.finish().unwrap(), data.len() as u64);
        let mut wire = a.out.clone();
        wire.extend_from_slice(b"after the end");
        let mut b = pipe(wire);
        let mut r = ChunkReader::new(&mut b);
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, data);
        assert!(r.ended().unwrap());
        let mut rest = Vec::new();
        b.input.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"after the end", "the reader stops at the end marker");
    }

    #[test]
    fn a_cut_or_hostile_stream_is_an_error_not_a_short_read() {
        let mut a = pipe(Vec::new());
        let mut w = ChunkWriter::new(&mut a);
        w.write_all(&[9u8; 1000]).unwrap();
        w.finish().unwrap();
        let cut = a.out[..500].to_vec();
        let mut b = pipe(cut);
        let e = ChunkReader::new(&mut b).read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let mut huge = ((CHUNK + 1) as u32).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 16]);
        let mut b = pipe(huge);
        let e = ChunkReader::new(&mut b).read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn answers_carry_their_status_reason_and_numbers() {
        let mut a = pipe(Vec::new());
        answer(&mut a, 0, "", 7, 9).unwrap();
        answer(&mut a, 3, "no room", 0, 0).unwrap();
        answer(&mut a, 1, &"x".repeat(5000), 0, 0).unwrap();
        let mut b = pipe(a.out.clone());
        assert_eq!(read_answer(&mut b).unwrap(), Ok((7, 9)));
        assert_eq!(read_answer(&mut b).unwrap(), Err("no room".to_string()));
        assert_eq!(read_answer(&mut b).unwrap(), Err("x".repeat(MAX_REASON)), "a long reason is cut, never refused");
        let mut bad = 1u32.to_le_bytes().to_vec();
        bad.extend_from_slice(&((MAX_REASON + 1) as u32).to_le_bytes());
        let e = read_answer(&mut pipe(bad)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
