//! The JetStream streams of `examples/nats.rs`, for the tests that publish to them or
//! settle against them (feature `brokers`).

use async_nats::jetstream::{self, stream};

/// Creates the stream `name` on `subject` and its dead-letter stream `{name}_DEAD` on
/// `{subject}.dead`, as `examples/nats.rs` does; returns both (the stream first). `url`
/// is the server's, for the message of the panic when JetStream refuses: a test's setup.
pub async fn streams(
    jetstream: &jetstream::Context,
    url: &str,
    name: &str,
    subject: &str,
) -> (stream::Stream, stream::Stream) {
    let dead = jetstream
        .create_stream(stream::Config {
            name: format!("{name}_DEAD"),
            subjects: vec![format!("{subject}.dead")],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|error| {
            panic!("create a JetStream stream at {url} (is JetStream enabled?): {error}")
        });
    let stream = jetstream
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    (stream, dead)
}
