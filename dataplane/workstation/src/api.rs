//! The tunnel API client: gRPC (HTTP/2 without TLS) on a forward tunnel stream to
//! `spur-tunnel-api:443`, which the tunnel proxy serves itself. The tunnel is already
//! authenticated and encrypted, so every call is made as the session's workstation.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use spur_proto::tunnel::tunnel_api_client::TunnelApiClient;
use spur_proto::{TUNNEL_API_HOST, TUNNEL_API_PORT};
use spur_tunnel::TunnelClient;
use tonic::transport::{Channel, Endpoint};

use crate::Error;

/// A client of the tunnel API over `client`'s current session. Each HTTP/2 connection is one
/// tunnel stream; when the session is lost, calls fail and the caller connects again.
pub async fn connect(
    client: Arc<TunnelClient>,
    timeout: Duration,
) -> Result<TunnelApiClient<Channel>, Error> {
    let endpoint = Endpoint::from_shared(format!("http://{TUNNEL_API_HOST}:{TUNNEL_API_PORT}"))
        .map_err(|e| Error::Config(e.to_string()))?
        .connect_timeout(timeout);
    let connector = tower::service_fn(move |_uri: http::Uri| {
        let client = client.clone();
        async move {
            let stream = client.open(TUNNEL_API_HOST, TUNNEL_API_PORT).await?;
            Ok::<_, spur_tunnel::Error>(TokioIo::new(stream))
        }
    });
    let channel = endpoint.connect_with_connector(connector).await?;
    Ok(TunnelApiClient::new(channel))
}
