//! `--algo socket`: the floor a p2p get is measured against, in the same run: rank 1 sends a
//! plain TCP request over loopback and rank 0 answers with the object's bytes. Only for ranks
//! that are threads of one process (`--local`): rank 0 publishes its listening address here.

use super::sync::now_ns;
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Rank 0's listening address, for rank 1 (threads of one process).
static SERVER: Mutex<Option<SocketAddr>> = Mutex::new(None);

pub struct Socket {
    size: u64,
    /// Rank 1's connection, made at the first request.
    client: Option<Mutex<Option<TcpStream>>>,
}

impl Socket {
    /// Rank 0 starts a server thread that answers every 8-byte request with `size` bytes;
    /// rank 1 connects at its first request; other ranks take no part.
    pub fn new(rank: u32, size: u64) -> Result<Socket> {
        if rank == 0 {
            let l = TcpListener::bind("127.0.0.1:0").context("socket baseline: bind")?;
            *SERVER.lock().unwrap() = Some(l.local_addr()?);
            std::thread::Builder::new()
                .name("bench-socket".into())
                .spawn(move || serve(l, size))?;
        }
        Ok(Socket {
            size,
            client: (rank == 1).then(|| Mutex::new(None)),
        })
    }

    /// Rank 1: one request answered; returns when the last byte is in. Others: `None`.
    pub fn request(&self) -> Result<Option<u64>> {
        let Some(client) = &self.client else {
            return Ok(None);
        };
        let mut c = client.lock().unwrap();
        if c.is_none() {
            *c = Some(connect()?);
        }
        let s = c.as_mut().expect("connected");
        s.write_all(&self.size.to_le_bytes())?;
        let mut buf = vec![0u8; self.size as usize];
        s.read_exact(&mut buf)?;
        let done = now_ns();
        if buf.iter().enumerate().any(|(i, &b)| b != i as u8) {
            bail!("socket baseline: corrupted answer");
        }
        Ok(Some(done))
    }
}

fn connect() -> Result<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(addr) = *SERVER.lock().unwrap() {
            let s = TcpStream::connect(addr).context("socket baseline: connect")?;
            s.set_nodelay(true)?;
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("socket baseline: rank 0 has no server (is this --local?)");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Answers requests on the first connection until it closes.
fn serve(l: TcpListener, size: u64) {
    let Ok((mut s, _)) = l.accept() else { return };
    let _ = s.set_nodelay(true);
    let answer: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut req = [0u8; 8];
    while s.read_exact(&mut req).is_ok() {
        if s.write_all(&answer).is_err() {
            return;
        }
    }
}
