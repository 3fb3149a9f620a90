//! Tasks a process cannot do without (a router's health checks, a
//! sidecar's event subscription): one that ends before the process is
//! asked to stop (a panic, a bug) must stop the process, not leave it up,
//! answering its health checks, with that work silently undone. A
//! supervisor (Kubernetes, compose) then restarts it.

use std::future::Future;

use tokio::task::JoinHandle;

/// The critical tasks of a process, by name.
#[derive(Debug, Default)]
pub struct Critical {
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

impl Critical {
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.push((name, tokio::spawn(task)));
    }

    /// Waits until one of the tasks ends (never, if there is none) and
    /// returns its name and how it ended; it is no longer held. Cancel-safe.
    pub async fn one_ended(&mut self) -> (&'static str, String) {
        if self.tasks.is_empty() {
            return std::future::pending().await;
        }
        let (out, i, _) = futures::future::select_all(self.tasks.iter_mut().map(|(_, h)| h)).await;
        let (name, _) = self.tasks.swap_remove(i);
        let how = match out {
            Ok(()) => "returned".to_owned(),
            Err(e) if e.is_panic() => format!("panicked: {}", panic_message(e.into_panic())),
            Err(e) => e.to_string(),
        };
        (name, how)
    }

    /// Waits for every task still held to end.
    pub async fn join_all(self) {
        futures::future::join_all(self.tasks.into_iter().map(|(_, h)| h)).await;
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => {
            payload.downcast::<&'static str>().map_or_else(|_| "(no message)".to_owned(), |s| (*s).to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_ends_is_named_with_how_and_the_rest_are_kept() {
        let mut critical = Critical::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        critical.spawn("waits", async move {
            let _ = stopped.await;
        });
        critical.spawn("panics", async { panic!("index out of bounds") });
        assert_eq!(critical.one_ended().await, ("panics", "panicked: index out of bounds".to_owned()));
        stop.send(()).unwrap();
        assert_eq!(critical.one_ended().await, ("waits", "returned".to_owned()));
        critical.join_all().await;
    }
}
