//! An HTTP body read whole, but never past a cap: what a router reads from
//! an engine's `/metrics` or another replica's answer, and a sidecar from
//! its engine's `/metrics` and `/v1/models` or a router's answer. Whatever
//! answers at a configured address cannot make the reader buffer more.
//! Generic over [`http_body::Body`] (a `reqwest::Response` converts into
//! `reqwest::Body`), so no HTTP stack is needed here.

use bytes::Buf;
use http_body::Body;
use http_body_util::BodyExt;

/// The most of a vLLM engine's `/metrics` page that is read (the router's
/// health checks and the sidecar's load scrapes): vLLM's is tens to a few
/// hundred kB, a histogram per model and LoRA adapter adding a few.
pub const MAX_ENGINE_METRICS_BYTES: usize = 8 << 20;

/// `body`'s bytes, or `None` as soon as they would pass `limit` (the rest
/// is not read).
pub async fn read_within<B: Body>(body: B, limit: usize) -> Result<Option<Vec<u8>>, B::Error> {
    let mut body = std::pin::pin!(body);
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(mut data) = frame?.into_data() else { continue }; // trailers
        if read.len() + data.remaining() > limit {
            return Ok(None);
        }
        while data.has_remaining() {
            let chunk = data.chunk();
            read.extend_from_slice(chunk);
            let n = chunk.len();
            data.advance(n);
        }
    }
    Ok(Some(read))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use futures::executor::block_on;
    use http_body::Frame;
    use http_body_util::StreamBody;

    use super::*;

    /// A body of data frames of these sizes, and a trailer.
    fn frames(sizes: &[usize]) -> impl Body<Data = Bytes, Error = Infallible> {
        let mut frames: Vec<Result<Frame<Bytes>, Infallible>> =
            sizes.iter().map(|&n| Ok(Frame::data(Bytes::from(vec![b'x'; n])))).collect();
        frames.push(Ok(Frame::trailers(Default::default())));
        StreamBody::new(futures::stream::iter(frames))
    }

    #[test]
    fn a_body_up_to_the_limit_is_read_whole_and_one_past_it_refused() {
        assert_eq!(block_on(read_within(frames(&[3, 4, 3]), 10)).unwrap().map(|b| b.len()), Some(10));
        assert_eq!(block_on(read_within(frames(&[3, 4, 4]), 10)).unwrap(), None);
        assert_eq!(block_on(read_within(frames(&[11]), 10)).unwrap(), None);
        assert_eq!(block_on(read_within(frames(&[]), 10)).unwrap(), Some(Vec::new()));
    }
}
