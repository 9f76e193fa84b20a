//! What a failing watch does to the controller it wakes: a side watch's errors are logged and
//! kept from the controller, so one watch that keeps failing does not hold back the others.

use futures_util::{Stream, StreamExt};
use kube::runtime::watcher;

/// The events of a watch that wakes `controller` beside its own objects (`what`: "Argo
/// Rollouts", say), with its errors logged here instead of passed on. `watch` must back off by
/// itself (`default_backoff()`): nothing else paces its retries once its errors stop here.
///
/// kube-runtime backs off a controller's whole trigger stream after an error from any watch in
/// it (`Controller::trigger_backoff`), and no watch of it is polled while it waits: a watch that
/// keeps failing (a CRD not installed, a list the role may not do) would hold every pass of that
/// controller for up to the backoff's cap, 30 s, most of the time. The watch's own backoff paces
/// its retries and these lines.
pub fn errors_logged<K, S>(
    controller: &'static str,
    what: &'static str,
    watch: S,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + use<K, S>
where
    S: Stream<Item = Result<K, watcher::Error>> + Send,
    K: Send,
{
    watch.filter_map(move |r| {
        std::future::ready(match r {
            Ok(obj) => Some(Ok(obj)),
            Err(e) => {
                if resource_missing(&e) {
                    tracing::debug!(controller, watch = what, error = %e, "a watched resource is not installed; retrying");
                } else {
                    tracing::warn!(controller, watch = what, error = %e, "a watch of this controller failed; retrying");
                }
                None
            }
        })
    })
}

/// Whether a watch failed because its resource does not exist in the cluster (404).
pub(crate) fn resource_missing(e: &watcher::Error) -> bool {
    use watcher::Error as W;
    match e {
        W::InitialListFailed(kube::Error::Api(s))
        | W::WatchStartFailed(kube::Error::Api(s))
        | W::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        W::WatchError(s) => s.code == 404,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    use futures_util::stream;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::controller::Action;
    use kube::runtime::reflector::{self, reflector};
    use kube::runtime::watcher::Event;
    use kube::runtime::{Controller, WatchStreamExt};
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    #[test]
    fn only_a_missing_resource_is_quiet() {
        use watcher::Error as W;
        let status = |code: u16| -> Box<kube::core::Status> {
            Box::new(serde_json::from_value(serde_json::json!({"code": code})).unwrap())
        };
        assert!(resource_missing(&W::InitialListFailed(kube::Error::Api(
            status(404)
        ))));
        assert!(resource_missing(&W::WatchError(status(404))));
        assert!(!resource_missing(&W::InitialListFailed(kube::Error::Api(
            status(403)
        ))));
        assert!(!resource_missing(&W::NoResourceVersion));
    }

    #[tokio::test]
    async fn errors_are_dropped_objects_pass() {
        let got: Vec<_> = errors_logged(
            "test",
            "configmaps",
            stream::iter([
                Ok(1),
                Err(watcher::Error::NoResourceVersion),
                Ok(2),
                Err(watcher::Error::NoResourceVersion),
            ]),
        )
        .map(Result::unwrap)
        .collect()
        .await;
        assert_eq!(got, [1, 2]);
    }

    fn cm(name: &str) -> ConfigMap {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "namespace": "ns"}}))
            .unwrap()
    }

    /// The most a change of the controller's own objects waited for its pass (virtual time),
    /// while a side watch fails every second. Eight changes, 3 s apart, after 20 s of failures.
    async fn longest_wait(side: impl FnOnce(Watch) -> Watch) -> Duration {
        let (reader, writer) = reflector::store::<ConfigMap>();
        let (tx, rx) = mpsc::channel::<Event<ConfigMap>>(16);
        let own =
            reflector(writer, tokio_stream_from(rx).map(Ok::<_, watcher::Error>)).applied_objects();
        let failing: Watch = Box::pin(stream::unfold((), |()| async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Some((Err(watcher::Error::NoResourceVersion), ()))
        }));
        let (passed, mut passes) = mpsc::unbounded_channel::<(String, Instant)>();
        let controller = Controller::for_stream(own, reader)
            .watches_stream(side(failing), |_: ConfigMap| {
                Vec::<reflector::ObjectRef<ConfigMap>>::new()
            })
            .run(
                move |obj: Arc<ConfigMap>, _ctx: Arc<()>| {
                    let passed = passed.clone();
                    async move {
                        let _ = passed.send((obj.metadata.name.clone().unwrap(), Instant::now()));
                        Ok::<_, std::convert::Infallible>(Action::await_change())
                    }
                },
                |_, _, _| Action::await_change(),
                Arc::new(()),
            )
            .for_each(|_| std::future::ready(()));
        let run = tokio::spawn(controller);
        tx.send(Event::Init).await.unwrap();
        tx.send(Event::InitDone).await.unwrap();
        tokio::time::sleep(Duration::from_secs(20)).await;
        let mut longest = Duration::ZERO;
        for i in 0..8 {
            let name = format!("cm{i}");
            let sent = Instant::now();
            tx.send(Event::Apply(cm(&name))).await.unwrap();
            let (got, at) = passes.recv().await.unwrap();
            assert_eq!(got, name);
            longest = longest.max(at - sent);
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        run.abort();
        longest
    }

    type Watch = std::pin::Pin<Box<dyn Stream<Item = Result<ConfigMap, watcher::Error>> + Send>>;

    fn tokio_stream_from<T: Send + 'static>(
        mut rx: mpsc::Receiver<T>,
    ) -> impl Stream<Item = T> + Send {
        stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_side_watch_does_not_hold_the_controller() {
        let logged = longest_wait(|w| Box::pin(errors_logged("test", "failing", w))).await;
        assert!(logged < Duration::from_millis(100), "{logged:?}");
        // What the kit keeps from happening: passed on, the errors pause every trigger.
        let passed_on = longest_wait(|w| w).await;
        assert!(passed_on > Duration::from_secs(1), "{passed_on:?}");
    }
}
