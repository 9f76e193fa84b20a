//! `spur-l4-upstream --udp-echo ADDR... --tcp-source ADDR...`: the L4 benchmark's upstream
//! (`perf/l4.sh`). UDP echo: every datagram goes back to its sender unchanged (a blocking thread
//! per socket, one `recvfrom` and one `sendto` per datagram, no allocation; `spur demo serve
//! --kind udp` prefixes its name and runs through tokio, which would cost the shared client
//! core more per datagram). TCP source: every accepted connection is sent 64 KiB chunks until it
//! closes (a thread per connection); what the client sends is read and dropped. Prints `ready`
//! once every socket is bound, then serves until killed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};

use anyhow::Context as _;
use clap::Parser;
use socket2::{Domain, Protocol, Socket, Type};

#[derive(Parser)]
#[command(
    name = "spur-l4-upstream",
    about = "L4 benchmark upstream: UDP echo and TCP source"
)]
struct Args {
    /// A UDP echo socket (repeatable).
    #[arg(long = "udp-echo", value_name = "ADDR")]
    udp_echo: Vec<SocketAddr>,
    /// A TCP source listener (repeatable): writes 64 KiB chunks to every connection.
    #[arg(long = "tcp-source", value_name = "ADDR")]
    tcp_source: Vec<SocketAddr>,
}

/// Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max × 2).
const SOCKET_BUFFER: usize = 4 << 20;
const CHUNK: usize = 64 * 1024;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        !args.udp_echo.is_empty() || !args.tcp_source.is_empty(),
        "nothing to serve: give --udp-echo and/or --tcp-source"
    );
    let mut threads = Vec::new();
    for addr in &args.udp_echo {
        let s = Socket::new(Domain::for_address(*addr), Type::DGRAM, Some(Protocol::UDP))?;
        let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
        let _ = s.set_send_buffer_size(SOCKET_BUFFER);
        s.bind(&(*addr).into())
            .with_context(|| format!("binding udp {addr}"))?;
        let socket: UdpSocket = s.into();
        threads.push(std::thread::spawn(move || udp_echo(&socket)));
    }
    for addr in &args.tcp_source {
        let l = TcpListener::bind(addr).with_context(|| format!("binding tcp {addr}"))?;
        threads.push(std::thread::spawn(move || tcp_source(&l)));
    }
    println!("ready");
    std::io::stdout().flush()?;
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

fn udp_echo(socket: &UdpSocket) {
    let mut buf = vec![0u8; 65_535];
    loop {
        // Errors (an ICMP error of an earlier reply) are not fatal.
        if let Ok((n, peer)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(&buf[..n], peer);
        }
    }
}

fn tcp_source(listener: &TcpListener) {
    for stream in listener.incoming().flatten() {
        std::thread::spawn(move || source(stream));
    }
}

fn source(stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    // Whatever the client sends is read and dropped, so a client that writes never blocks.
    if let Ok(mut reader) = stream.try_clone() {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; CHUNK];
            while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
        });
    }
    let chunk = vec![0x5au8; CHUNK];
    let mut w = stream;
    while w.write_all(&chunk).is_ok() {}
}
