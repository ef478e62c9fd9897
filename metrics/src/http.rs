//! A minimal HTTP/1.1 endpoint for Prometheus scrapes: `GET /metrics`
//! answers the rendered metrics, anything else 404 (or 405 for another
//! method), one request per connection.
//!
//! A scraper is a client like any other, so what it can make the daemon do
//! is bounded: the request head is at most [`MAX_HEAD`] bytes and must
//! arrive within [`READ_TIMEOUT`], at most [`MAX_CONNECTIONS`] are served
//! at once (others are closed at accept), and the body is whatever the
//! daemon renders, never an echo of the request. A full HTTP server would
//! bring a dependency tree larger than the rest of a daemon for one route.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Largest request head read.
pub const MAX_HEAD: usize = 8192;
/// How long a client has to send its request head and read the answer.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once.
pub const MAX_CONNECTIONS: usize = 16;

/// The content type of `prometheus-client`'s text encoding.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders the current metrics; called once per scrape on the serving task.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

/// Binds the metrics address (`host:port`, port 0 picks one).
pub async fn bind(addr: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(addr).await.map_err(|source| Error::Bind { addr: addr.to_string(), source })
}

/// Serves scrapes on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, render: Render, shutdown: CancellationToken) {
    if let Ok(a) = listener.local_addr() {
        // Not only through tracing: scripts and tests wait for this line.
        eprintln!("metrics on http://{a}/metrics");
        info!(addr = %a, "serving metrics");
    }
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (sock, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors and the like: wait rather than spin.
                    warn!("metrics accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(%peer, "metrics: too many scrapes at once; closing");
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::time::timeout(READ_TIMEOUT, answer(sock, &render)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(%peer, "metrics request: {e}"),
                Err(_) => debug!(%peer, "metrics request timed out"),
            }
        });
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics,
    NotFound,
    BadMethod,
    Bad,
}

fn route(head: &[u8]) -> Route {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = std::str::from_utf8(line).unwrap_or("").trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next()) else {
        return Route::Bad;
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Route::Bad;
    }
    if method != "GET" && method != "HEAD" {
        return Route::BadMethod;
    }
    // Prometheus may add query parameters; they select nothing here.
    match target.split('?').next() {
        Some("/metrics") => Route::Metrics,
        _ => Route::NotFound,
    }
}

async fn answer(mut sock: TcpStream, render: &Render) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = sock.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break;
        }
        if head.len() > MAX_HEAD {
            return respond(&mut sock, "431 Request Header Fields Too Large", "text/plain", b"request head too large\n", false).await;
        }
    }
    let is_head = head.starts_with(b"HEAD ");
    match route(&head) {
        Route::Metrics => {
            let body = render();
            respond(&mut sock, "200 OK", CONTENT_TYPE, body.as_bytes(), is_head).await
        }
        Route::NotFound => respond(&mut sock, "404 Not Found", "text/plain", b"metrics are at /metrics\n", is_head).await,
        Route::BadMethod => respond(&mut sock, "405 Method Not Allowed", "text/plain", b"GET /metrics\n", false).await,
        Route::Bad => respond(&mut sock, "400 Bad Request", "text/plain", b"bad request\n", false).await,
    }
}

async fn respond(sock: &mut TcpStream, status: &str, ctype: &str, body: &[u8], head_only: bool) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await?;
    if !head_only {
        sock.write_all(body).await?;
    }
    sock.shutdown().await
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"HEAD /metrics HTTP/1.1\r\n\r\n"), Route::Metrics);
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n"), Route::BadMethod);
        assert_eq!(route(b"GET /metrics\r\n\r\n"), Route::Bad);
        assert_eq!(route(b"GET /metrics SPDY/3 extra\r\n\r\n"), Route::Bad);
        assert_eq!(route(b"\xff\xfe\r\n\r\n"), Route::Bad);
    }

    async fn get(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_the_rendered_text_and_bounds_the_request() {
        let listener = bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let render: Render = Arc::new(|| "# TYPE x counter\nx_total 7\n# EOF\n".to_string());
        let task = tokio::spawn(serve(listener, render, stop.clone()));
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains(CONTENT_TYPE) && ok.ends_with("x_total 7\n# EOF\n"), "{ok}");
        let missing = get(addr, b"GET /other HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let mut huge = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
        let big = get(addr, &huge).await;
        assert!(big.starts_with("HTTP/1.1 431"), "{big}");
        stop.cancel();
        task.await.unwrap();
    }
}
