//! hf2q-server: `hf2q serve`, an OpenAI-compatible HTTP server with continuous batching and a
//! web chat.
//!
//! Layout: [`engine`] owns the model on its own thread and schedules sequences into batched
//! forward steps; [`openai`] is the wire format, [`chat_tools`] its tool-calling and
//! structured-output part; [`routes`] the HTTP surface; [`metrics`] the Prometheus page; [`ui`]
//! the embedded web chat; [`agent`] the workspace tools and approvals of agent mode. [`start`] wires them to a socket; [`run`] is
//! the blocking entry point of the CLI (signals, drain, exit status).
//!
//! HTTP stack: tokio + axum (over hyper 1). axum gives routing, extractors with typed
//! rejections (needed for 413 vs 400), middleware for auth/CORS/metrics, streaming bodies for
//! SSE and graceful shutdown, with little code of its own over hyper; every async piece of the
//! ecosystem speaks tokio. Plain hyper would mean rewriting routing and middleware; actix-web
//! brings its own runtime model. The engine does not run on the async runtime: model steps are
//! long CPU-bound calls, so they get a dedicated thread and talk to handlers through channels.

pub mod agent;
pub mod chat_tools;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod ui;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hf2q_models::Model;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use engine::{Engine, EngineConfig};

/// Everything `hf2q serve` can be told.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind; loopback by default so that nothing is exposed by accident.
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// Name of the model in `/v1/models` and in responses.
    pub model_id: String,
    /// Required as `Authorization: Bearer KEY` on everything but `/health` and the web chat.
    pub api_key: Option<String>,
    /// Origins allowed to call the API from a browser (`*` = any); empty = no CORS headers.
    pub cors_origins: Vec<String>,
    pub max_body_bytes: usize,
    /// Per-request limit: queued requests fail with 503 after it, running ones end with
    /// `finish_reason: "length"`. Zero = none.
    pub request_timeout: Duration,
    /// How long SIGTERM waits for running requests before aborting them.
    pub drain_timeout: Duration,
    /// `/health` reports 503 when the engine is busy and has not finished a step for this long.
    pub stuck_after: Duration,
    pub engine: EngineConfig,
    /// Agent mode (`--workspace DIR`): the `/api/agent` tools over this folder. Off when `None`.
    pub agent: Option<agent::AgentConfig>,
    /// The Lab's jobs and models (`/api/jobs`, `/api/models`). Off when `None`.
    pub lab: Option<hf2q_lab::Lab>,
    /// LoRA adapters served from the start beside the base: (name, PEFT folder).
    pub adapters: Vec<(String, std::path::PathBuf)>,
    /// Folders under which `POST /v1/adapters` may load adapters (canonical paths; empty: run-time
    /// loading is off).
    pub adapter_roots: Vec<std::path::PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_id: "model".into(),
            api_key: None,
            cors_origins: Vec::new(),
            max_body_bytes: 4 << 20,
            request_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(30),
            stuck_after: Duration::from_secs(60),
            engine: EngineConfig::default(),
            agent: None,
            lab: None,
            adapters: Vec::new(),
            adapter_roots: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Model(#[from] hf2q_models::Error),
    #[error("the engine thread died; the server cannot answer requests")]
    EngineDied,
    #[error("{0}")]
    Config(String),
}

impl ServerConfig {
    /// Checks the limits make sense together.
    pub fn validate(&self) -> Result<(), Error> {
        let e = &self.engine;
        let bad = |m: String| Err(Error::Config(m));
        if e.ctx_size < 2 {
            return bad(format!("context size {} is too small", e.ctx_size));
        }
        if e.max_seqs == 0 || e.max_queue == 0 {
            return bad("--max-seqs and --max-queue must be at least 1".into());
        }
        if e.max_batch_tokens < e.max_seqs {
            return bad(format!(
                "--max-batch-tokens ({}) must be at least --max-seqs ({}): every running sequence needs one token per step",
                e.max_batch_tokens, e.max_seqs
            ));
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return bad("--api-key must not be empty".into());
        }
        for (i, (name, _)) in self.adapters.iter().enumerate() {
            if !engine::adapters::valid_name(name) || *name == self.model_id {
                return bad(format!(
                    "--adapter {name}=...: an adapter name is 1 to 64 of A-Z a-z 0-9 . _ - and not the base model's name"
                ));
            }
            if self.adapters[..i].iter().any(|(n, _)| n == name) {
                return bad(format!("--adapter {name}=... is given twice"));
            }
        }
        Ok(())
    }
}

/// A running server.
pub struct ServerHandle {
    pub addr: SocketAddr,
    pub engine: Engine,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), Error>>,
}

impl ServerHandle {
    /// Starts the drain: no new requests, running ones finish (up to the drain timeout).
    pub fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
    /// Waits until the server has stopped: `Ok` after a drain, `Err(EngineDied)` when the engine
    /// thread died.
    pub async fn wait(self) -> Result<(), Error> {
        self.task
            .await
            .map_err(|e| Error::Config(format!("server task failed: {e}")))?
    }
}

/// Starts the engine over `model` and serves on `cfg.host:cfg.port`. Must be called inside a
/// tokio runtime.
pub async fn start(model: Arc<Model>, cfg: ServerConfig) -> Result<ServerHandle, Error> {
    cfg.validate()?;
    let engine = Engine::start(model, cfg.engine.clone())?;
    for (name, dir) in &cfg.adapters {
        let read = engine
            .model()
            .read_adapter(dir)
            .map_err(|e| Error::Config(format!("--adapter {name}: {e}")))?;
        engine
            .install(name, dir.clone(), read)
            .await
            .map_err(|e| Error::Config(format!("--adapter {name}: {e}")))?;
    }
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).await?;
    let addr = listener.local_addr()?;
    if let Some(lab) = &cfg.lab {
        lab.set_api(hf2q_lab::ServerApi {
            base_url: own_base_url(addr),
            key: cfg.api_key.clone(),
        });
    }
    let state = Arc::new(routes::AppState::new(engine.clone(), cfg.clone())?);
    let app = routes::router(state);
    let (stop, stop_rx) = oneshot::channel();
    let task = tokio::spawn(serve_until(
        listener,
        app,
        engine.clone(),
        cfg.drain_timeout,
        stop_rx,
    ));
    Ok(ServerHandle {
        addr,
        engine,
        stop: Some(stop),
        task,
    })
}

/// The `/v1` base URL this process reaches the server at: its address, loopback for an
/// unspecified one (0.0.0.0, ::).
pub fn own_base_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    format!("http://{}/v1", SocketAddr::new(ip, addr.port()))
}

async fn serve_until(
    listener: TcpListener,
    app: axum::Router,
    engine: Engine,
    drain_timeout: Duration,
    stop: oneshot::Receiver<()>,
) -> Result<(), Error> {
    let (graceful, graceful_rx) = oneshot::channel::<()>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = graceful_rx.await;
    });
    let mut server = std::pin::pin!(server.into_future());
    tokio::select! {
        r = &mut server => {
            r?;
            return Ok(());
        }
        _ = engine.dead() => return Err(Error::EngineDied),
        _ = stop => {}
    }
    // Drain: refuse new work, stop accepting connections, let running requests finish.
    engine.start_draining();
    let _ = graceful.send(());
    tokio::select! {
        _ = &mut server => {}
        _ = tokio::time::sleep(drain_timeout) => {
            eprintln!("drain timeout: aborting the requests still running");
            engine.abort_all("the server is shutting down");
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut server).await;
        }
        _ = engine.dead() => return Err(Error::EngineDied),
    }
    engine.stop();
    Ok(())
}

/// The CLI's entry point: serves until SIGTERM or Ctrl-C, then drains and returns `Ok`; returns
/// `Err` when the engine dies (the process should then exit non-zero). A second signal during
/// the drain stops at once.
pub fn run(model: Model, cfg: ServerConfig) -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("hf2q-http")
        .build()?;
    rt.block_on(async move {
        let h = start(Arc::new(model), cfg).await?;
        eprintln!("listening on http://{}", h.addr);
        eprintln!("web chat: http://{}/   API: http://{}/v1", h.addr, h.addr);
        let ServerHandle { stop, mut task, .. } = h;
        let flatten = |r: Result<Result<(), Error>, tokio::task::JoinError>| r.map_err(|e| Error::Config(e.to_string()))?;
        tokio::select! {
            r = &mut task => return flatten(r),
            _ = shutdown_signal() => {}
        }
        eprintln!("shutting down: finishing running requests (a second signal stops at once)");
        if let Some(s) = stop {
            let _ = s.send(());
        }
        tokio::select! {
            r = &mut task => flatten(r),
            _ = shutdown_signal() => Err(Error::Config("stopped by a second signal before the drain finished".into())),
        }
    })
}

/// SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())
            .map_err(|e| eprintln!("warning: cannot handle SIGTERM: {e}"))
            .ok();
        let mut int = signal(SignalKind::interrupt())
            .map_err(|e| eprintln!("warning: cannot handle SIGINT: {e}"))
            .ok();
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = wait(term.take()) => {}
            _ = wait(int.take()) => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::own_base_url;

    #[test]
    fn the_jobs_reach_an_unspecified_address_on_loopback() {
        let url = |s: &str| own_base_url(s.parse().unwrap());
        assert_eq!(url("127.0.0.1:8080"), "http://127.0.0.1:8080/v1");
        assert_eq!(url("0.0.0.0:81"), "http://127.0.0.1:81/v1");
        assert_eq!(url("[::]:82"), "http://[::1]:82/v1");
        assert_eq!(url("10.1.2.3:83"), "http://10.1.2.3:83/v1");
    }
}
