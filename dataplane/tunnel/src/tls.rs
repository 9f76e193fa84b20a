//! rustls (ring provider) configurations for both transports: TLS 1.3 only with the tunnel's
//! own ALPN for QUIC, TLS 1.2/1.3 with ALPN `h2` for the fallback.

use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;

use crate::bbr::BbrConfig;
use crate::config::{ClientTls, Congestion, Keepalive, Limits, ServerCert, ServerTls};
use crate::error::Error;
use crate::wire::{H2_ALPN, QUIC_ALPN};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(certs: &[rustls::pki_types::CertificateDer<'static>]) -> Result<RootCertStore, Error> {
    let mut store = RootCertStore::empty();
    for cert in certs {
        store.add(cert.clone())?;
    }
    Ok(store)
}

pub(crate) struct ServerTlsConfigs {
    pub quic: quinn::crypto::rustls::QuicServerConfig,
    pub h2: Arc<rustls::ServerConfig>,
}

pub(crate) fn server_configs(tls: &ServerTls) -> Result<ServerTlsConfigs, Error> {
    let provider = provider();
    let resolver: Arc<dyn rustls::server::ResolvesServerCert> = match &tls.cert {
        ServerCert::Static { chain, key } => {
            let key = provider.key_provider.load_private_key(key.clone_key())?;
            Arc::new(SingleCert(Arc::new(CertifiedKey::new(chain.clone(), key))))
        }
        ServerCert::Resolver(r) => r.clone(),
    };
    let build = |versions: &[&'static rustls::SupportedProtocolVersion],
                 alpn: &[u8]|
     -> Result<rustls::ServerConfig, Error> {
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)?;
        let builder = if tls.client_ca.is_empty() {
            builder.with_no_client_auth()
        } else {
            let verifier = WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(&tls.client_ca)?),
                provider.clone(),
            );
            let verifier = if tls.require_client_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .map_err(|e| Error::Config(format!("client CA: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        };
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(config)
    };
    let quic = build(&[&rustls::version::TLS13], QUIC_ALPN)?;
    let quic =
        QuicServerConfig::try_from(quic).map_err(|e| Error::Config(format!("QUIC TLS: {e}")))?;
    let h2 = build(&[&rustls::version::TLS13, &rustls::version::TLS12], H2_ALPN)?;
    Ok(ServerTlsConfigs {
        quic,
        h2: Arc::new(h2),
    })
}

/// A resolver that always answers with one certificate.
#[derive(Debug)]
struct SingleCert(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for SingleCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

pub(crate) struct ClientTlsConfigs {
    pub quic: QuicClientConfig,
    pub h2: Arc<rustls::ClientConfig>,
}

pub(crate) fn client_configs(tls: &ClientTls) -> Result<ClientTlsConfigs, Error> {
    let provider = provider();
    let roots = Arc::new(roots(&tls.roots)?);
    let build = |versions: &[&'static rustls::SupportedProtocolVersion],
                 alpn: &[u8]|
     -> Result<rustls::ClientConfig, Error> {
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)?
            .with_root_certificates(roots.clone());
        let mut config = match &tls.client_cert {
            Some((chain, key)) => builder.with_client_auth_cert(chain.clone(), key.clone_key())?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(config)
    };
    let quic = QuicClientConfig::try_from(build(&[&rustls::version::TLS13], QUIC_ALPN)?)
        .map_err(|e| Error::Config(format!("QUIC TLS: {e}")))?;
    let h2 = build(&[&rustls::version::TLS13, &rustls::version::TLS12], H2_ALPN)?;
    Ok(ClientTlsConfigs {
        quic,
        h2: Arc::new(h2),
    })
}

/// The peer acknowledges once more than this many ack-eliciting packets have arrived (below).
const ACK_ELICITING_THRESHOLD: u32 = 3;

/// QUIC transport parameters from the tunnel's limits and keepalive.
pub(crate) fn quic_transport(
    limits: &Limits,
    keepalive: &Keepalive,
    congestion: Congestion,
) -> Result<quinn::TransportConfig, Error> {
    let mut t = quinn::TransportConfig::default();
    match congestion {
        Congestion::Bbr => {
            t.congestion_controller_factory(Arc::new(BbrConfig::for_ack_threshold(u64::from(
                ACK_ELICITING_THRESHOLD,
            ))));
        }
        Congestion::Cubic => {
            t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()));
        }
    }
    t.max_concurrent_bidi_streams(limits.max_streams.into());
    t.max_concurrent_uni_streams(0u8.into());
    t.stream_receive_window(limits.stream_window.into());
    t.receive_window(limits.connection_window.into());
    t.send_window(u64::from(limits.connection_window));
    t.keep_alive_interval(Some(keepalive.interval));
    let idle = quinn::IdleTimeout::try_from(keepalive.timeout)
        .map_err(|_| Error::Config("keepalive.timeout too large for QUIC".into()))?;
    t.max_idle_timeout(Some(idle));
    t.datagram_receive_buffer_size(None);
    // Ask the peer (quinn, on both ends) to acknowledge every 4th packet instead of every
    // other one, and within 5 ms: fewer ACK packets to build, send, receive and process per
    // byte carried (the tunnel is CPU-bound on a laptop), and, with the shorter delay, a
    // shorter probe timeout when the last packet of a burst is lost. Our BBR keeps its window
    // at twice this many packets or more, so no round trip waits out the ACK delay (the
    // module documentation of `bbr` says what went wrong with quinn's).
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.ack_eliciting_threshold(quinn::VarInt::from_u32(ACK_ELICITING_THRESHOLD))
        .max_ack_delay(Some(Duration::from_millis(5)));
    t.ack_frequency_config(Some(ack));
    Ok(t)
}

/// Upper bound on waiting for a peer to acknowledge data before a connection is closed.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
