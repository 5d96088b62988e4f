//! The client's end of the CSI server's unix socket, as kubelet and the
//! sidecars open it: used by the demo and the tests to play them.

use std::path::Path;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Opens a gRPC channel to the CSI server on the unix socket `socket`,
/// retrying every 100 ms until it answers or `wait` has passed (a server
/// just started may not listen yet); the last attempt's error is returned.
/// Each attempt gives up after 5 s. `timeout`, if set, bounds every request
/// made on the channel.
pub async fn unix_channel(
    socket: &Path,
    wait: Duration,
    timeout: Option<Duration>,
) -> Result<Channel, tonic::transport::Error> {
    let deadline = Instant::now() + wait;
    loop {
        let path = socket.to_owned();
        // The URI is a placeholder: the connector ignores it.
        let mut endpoint =
            Endpoint::from_static("http://[::1]:50051").connect_timeout(Duration::from_secs(5));
        if let Some(t) = timeout {
            endpoint = endpoint.timeout(t);
        }
        let attempt = endpoint
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await;
        match attempt {
            Ok(ch) => return Ok(ch),
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(e),
        }
    }
}
