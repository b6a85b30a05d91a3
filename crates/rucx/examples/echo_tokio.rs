//! A tokio echo service over rucx: what a service author would copy.
//!
//! ```text
//! echo_tokio server [ADDR]               listen (default 127.0.0.1:0), print the address, echo
//!                                        every message back until told to shut down
//! echo_tokio client ADDR [CLIENTS] [MSGS] CLIENTS concurrent clients (one worker each, on
//!                                        threads), each sending MSGS messages and checking
//!                                        every echo, then closing its endpoint (flush)
//! echo_tokio doomed ADDR                 one client that echoes 1 MiB messages forever (to be
//!                                        killed mid-request)
//! echo_tokio shutdown ADDR               tell the server to stop, wait for its answer
//! ```
//!
//! The server runs one worker under `rucx::tokio::drive`: it sleeps on the worker's event
//! descriptor when idle, receives into owned buffers (`tag_recv_owned`) and sends the very
//! buffer back (`tag_send_owned`), accepts new clients beside that (`rucx::tokio::accept`, which
//! sleeps on the listener's descriptor: a busy echo loop never holds up a connecting client, nor
//! a client that connects and says nothing the echoes), and logs each client that dies once (the
//! worker's error handler), going on with the others. Requires the `tokio` feature:
//! `cargo run --release -p rucx --features tokio --example echo_tokio`.

use std::time::Duration;

use rucx::ucp::CloseMode;
use rucx::{Error, Result, TAG_MASK_ANY, TAG_MASK_FULL, Worker};

const ECHO: u64 = 1;
const SHUTDOWN: u64 = 2;
const MAX_MSG: usize = 1 << 20;

fn worker() -> Result<Worker> {
    Worker::new(&rucx::context_from_env()?)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn server(addr: &str) -> Result<()> {
    let w = worker()?;
    let l = w.listen(addr)?;
    println!("listening on {}", l.local_addr());
    // Called once per endpoint: a client that closed its endpoint, or one that died.
    w.set_error_handler(|_, ep, e| match e {
        Error::EndpointClosed { .. } => println!("server: client {ep} disconnected"),
        e => eprintln!("server: client {ep} failed: {e}"),
    });
    let served = runtime().block_on(rucx::tokio::drive(&w, async {
        // New clients are accepted beside the echoes, neither waiting for the other.
        let accepting = async {
            loop {
                match rucx::tokio::accept(&w, &l).await {
                    Ok(ep) => println!("server: client {ep} connected"),
                    // One peer that could not connect (a stranger, one that hung up or went
                    // silent during the handshake): the listener goes on.
                    Err(e) => eprintln!("server: a client could not connect: {e}"),
                }
            }
        };
        tokio::select! {
            served = echo(&w) => served,
            () = accepting => unreachable!("accepting never ends"),
        }
    }))??;
    println!("server: shut down after {served} echoes");
    Ok(())
}

/// Echo every message back to its sender until a `SHUTDOWN` message: the number echoed.
async fn echo(w: &Worker) -> Result<u64> {
    let mut served = 0u64;
    loop {
        // One receive at a time from anyone; the echo goes back to its sender in the very
        // buffer received into.
        let (res, mut buf) = w.tag_recv_owned(vec![0u8; MAX_MSG], 0, TAG_MASK_ANY).await;
        let c = match res {
            Ok(c) => c,
            // A receive that met a dying sender's message: the handler logged the client.
            Err(e) => {
                eprintln!("server: a receive failed: {e}");
                continue;
            }
        };
        let Some(ep) = c.sender else { continue };
        if c.tag == SHUTDOWN {
            // The answer tells the sender that the server heard it and goes.
            w.tag_send_owned(ep, Vec::new(), SHUTDOWN).await.0?;
            return Ok(served);
        }
        buf.truncate(c.len);
        // Sends to a client that died meanwhile fail; the error handler said so.
        if let (Err(e), _) = w.tag_send_owned(ep, buf, ECHO).await {
            eprintln!("server: echo to {ep} failed: {e}");
        }
        served += 1;
    }
}

/// One client: `msgs` messages (`None`: forever, 1 MiB each), every echo checked.
fn client(addr: &str, id: usize, msgs: Option<usize>) -> Result<()> {
    let w = worker()?;
    let ep = w.connect_sockaddr(addr, Duration::from_secs(10))?;
    runtime().block_on(rucx::tokio::drive(&w, async {
        let mut i = 0usize;
        while msgs.is_none_or(|m| i < m) {
            let len = if msgs.is_some() {
                16 + (i * 37 + id) % 5000
            } else {
                MAX_MSG
            };
            let data: Vec<u8> = (0..len).map(|k| (k + i + id) as u8).collect();
            let (r, data) = w.tag_send_owned(ep, data, ECHO).await;
            r?;
            if i == 0 && msgs.is_none() {
                println!("doomed client started");
            }
            let (r, back) = w
                .tag_recv_owned(vec![0u8; MAX_MSG], ECHO, TAG_MASK_FULL)
                .await;
            let c = r?;
            if back[..c.len] != data[..] {
                return Err(Error::Internal(format!("client {id}: echo {i} differs")));
            }
            i += 1;
        }
        w.close(ep, CloseMode::Flush).await.0?;
        Ok(())
    }))?
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str);
    match (arg(1), arg(2)) {
        (Some("server"), a) => server(a.unwrap_or("127.0.0.1:0")),
        (Some("client"), Some(addr)) => {
            let n: usize = arg(3).and_then(|s| s.parse().ok()).unwrap_or(64);
            let msgs: usize = arg(4).and_then(|s| s.parse().ok()).unwrap_or(100);
            let threads: Vec<_> = (0..n)
                .map(|id| {
                    let addr = addr.to_string();
                    std::thread::spawn(move || client(&addr, id, Some(msgs)))
                })
                .collect();
            let mut failed = 0;
            for (id, t) in threads.into_iter().enumerate() {
                if let Err(e) = t.join().expect("client thread") {
                    eprintln!("client {id}: {e}");
                    failed += 1;
                }
            }
            println!("{} clients done, {failed} failed", n);
            if failed > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
        (Some("doomed"), Some(addr)) => client(addr, 0, None),
        (Some("shutdown"), Some(addr)) => {
            let w = worker()?;
            let ep = w.connect_sockaddr(addr, Duration::from_secs(10))?;
            // No close after the answer: the server is gone by then.
            rucx::block_on(&w, async {
                w.tag_send_owned(ep, Vec::new(), SHUTDOWN).await.0?;
                w.tag_recv_owned(Vec::new(), SHUTDOWN, TAG_MASK_FULL)
                    .await
                    .0
                    .map(drop)
            })??;
            println!("the server shuts down");
            Ok(())
        }
        _ => {
            eprintln!(
                "usage: echo_tokio server [ADDR] | client ADDR [CLIENTS] [MSGS] | doomed ADDR | shutdown ADDR"
            );
            std::process::exit(2);
        }
    }
}
