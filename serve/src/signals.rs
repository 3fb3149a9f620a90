//! A server process's stop signals: SIGTERM or SIGINT asks for a graceful
//! stop; a second one ends the process at once (exit code 130), as an
//! operator pressing Ctrl-C twice expects. The handlers are installed when
//! [`stop_requested`] is called, so call it first thing: a SIGTERM that
//! arrived while the process loaded its tokenizer or bound its port (the
//! kernel's default for a process that is PID 1 in a container is to
//! ignore it) left `docker stop` waiting for its SIGKILL.

use std::future::Future;

/// Installs the handlers; the future completes at the first signal.
pub fn stop_requested() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let (first, asked) = tokio::sync::oneshot::channel::<()>();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            let _ = first.send(());
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("a second stop signal: exiting now, without waiting for answers under way");
            std::process::exit(130);
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        let _ = first.send(());
        let _ = tokio::signal::ctrl_c().await;
        std::process::exit(130);
    });
    Ok(async move {
        // The sender gone without a signal (its task ended): stop too.
        let _ = asked.await;
    })
}
