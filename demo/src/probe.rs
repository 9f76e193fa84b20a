//! `spur-demo probe`: sessions to a listener of echo servers, for checking a ListenerSet's
//! spread, affinity and framing (docs/l4.md).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail};

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ProbeProtocol {
    Udp,
    Tcp,
}

pub(crate) struct Probe {
    pub(crate) target: SocketAddr,
    pub(crate) protocol: ProbeProtocol,
    pub(crate) size: Option<u32>,
    pub(crate) timeout: Duration,
}

/// The largest UDP payload over IPv4, and what the demo's UDP echo answers at most.
const MAX_DATAGRAM: usize = 65_507;

impl Probe {
    pub(crate) async fn run(
        &self,
        first: u32,
        sessions: u32,
        batch: u32,
        pause: Duration,
    ) -> Result<ExitCode> {
        let mut failed = false;
        let mut buf = vec![0u8; 65_536];
        let end = first.saturating_add(sessions);
        let mut start = first;
        while start < end {
            if start > first {
                tokio::time::sleep(pause).await;
            }
            let stop = start.saturating_add(batch.max(1)).min(end);
            // A batch's sockets stay open until it is done, so its sessions have distinct
            // source ports: a listener keeps a UDP session per client address, and a port used
            // again while the listener still holds its session would reach that session's
            // worker. One session at a time, so a listener sees no burst.
            let mut open = Vec::new();
            for n in start..stop {
                let payload = self.payload(n);
                let answer = match self.protocol {
                    ProbeProtocol::Udp => self.udp(&payload, &mut buf, &mut open).await,
                    ProbeProtocol::Tcp => self.tcp(&payload).await,
                };
                match answer {
                    Ok(who) => println!("{n} {who}"),
                    Err(e) => {
                        failed = true;
                        println!("{n} error {e:#}");
                    }
                }
            }
            drop(open);
            start = stop;
        }
        Ok(if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        })
    }

    fn payload(&self, n: u32) -> Vec<u8> {
        let mut p = format!("s{n:07}").into_bytes();
        if let Some(size) = self.size {
            p.resize(size as usize, b'.');
        }
        p
    }

    async fn udp(
        &self,
        payload: &[u8],
        buf: &mut [u8],
        open: &mut Vec<tokio::net::UdpSocket>,
    ) -> Result<String> {
        let bind: SocketAddr = if self.target.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let socket = tokio::net::UdpSocket::bind(bind).await?;
        socket.send_to(payload, self.target).await?;
        let (len, _) = tokio::time::timeout(self.timeout, socket.recv_from(buf))
            .await
            .map_err(|_| anyhow::anyhow!("no reply within {:?}", self.timeout))??;
        open.push(socket);
        let reply = &buf[..len];
        let Some(space) = reply.iter().position(|&b| b == b' ') else {
            bail!("unexpected reply {:?}", String::from_utf8_lossy(reply));
        };
        let (who, echoed) = (&reply[..space], &reply[space + 1..]);
        // The echo cuts what does not fit in one datagram after its name.
        let fits = payload.len().min(MAX_DATAGRAM.saturating_sub(space + 1));
        if echoed != &payload[..fits] {
            bail!(
                "the reply of {} bytes from {} does not echo the {} bytes sent",
                len,
                String::from_utf8_lossy(who),
                payload.len()
            );
        }
        Ok(String::from_utf8_lossy(who).into_owned())
    }

    async fn tcp(&self, payload: &[u8]) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(self.target).await?;
            stream.write_all(payload).await?;
            stream.shutdown().await?;
            let mut reply = Vec::new();
            stream.read_to_end(&mut reply).await?;
            anyhow::Ok(reply)
        };
        let reply = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| anyhow::anyhow!("no full reply within {:?}", self.timeout))??;
        let bye = reply
            .strip_prefix(payload)
            .and_then(|rest| rest.strip_prefix(b"bye from "))
            .and_then(|rest| rest.strip_suffix(b"\n"));
        match bye {
            Some(who) => Ok(String::from_utf8_lossy(who).into_owned()),
            None => bail!(
                "unexpected reply of {} bytes (want the {} sent, then `bye from <name>`): {:?}",
                reply.len(),
                payload.len(),
                String::from_utf8_lossy(&reply[..reply.len().min(200)])
            ),
        }
    }
}
