//! Envoy's external-processing messages as the endpoint-picker protocol uses them: reading
//! headers and the gateway's metadata, and building the picker's answers.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use http_body_util::BodyExt;

/// The header and metadata key of the picked endpoints (`ip:port[,ip:port...]`).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key under which the gateway reports the endpoint that served the request.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata key of the gateway's subset hint.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The metadata namespaces: the picked and served endpoints', and the subset hint's.
pub const LB_NAMESPACE: &str = "envoy.lb";
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";

/// Largest body piece in one streamed answer (Envoy's gRPC messages stay well under 4 MiB;
/// the protocol's reference implementation uses 62,000 bytes).
pub const BODY_CHUNK: usize = 62_000;

/// A request's headers as Envoy sent them: the pseudo-headers apart, the rest as HTTP headers
/// (a header whose name or value HTTP refuses is left out).
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
}

fn raw(h: &EnvoyHeader) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

impl RequestHead {
    pub fn of(headers: Option<&EnvoyHeaders>) -> Self {
        let mut head = RequestHead {
            method: String::new(),
            path: String::new(),
            headers: HeaderMap::new(),
        };
        for h in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
            let value = raw(h);
            match h.key.as_str() {
                ":method" => head.method = String::from_utf8_lossy(value).into_owned(),
                ":path" => head.path = String::from_utf8_lossy(value).into_owned(),
                key if key.starts_with(':') => {}
                key => {
                    if let (Ok(name), Ok(value)) =
                        (HeaderName::try_from(key), HeaderValue::from_bytes(value))
                    {
                        head.headers.append(name, value);
                    }
                }
            }
        }
        head
    }
}

/// The value of one header (`:status` included) of a message from Envoy.
pub fn header<'a>(headers: Option<&'a EnvoyHeaders>, name: &str) -> Option<&'a [u8]> {
    headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(raw)
}

fn field<'a>(metadata: Option<&'a Metadata>, namespace: &str, key: &str) -> Option<&'a Kind> {
    metadata?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()
}

/// The gateway's subset hint: the endpoints the pick must come from, when it gives them.
pub fn subset(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    match field(metadata, SUBSET_NAMESPACE, SUBSET)? {
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                    _ => None,
                })
                .collect(),
        ),
        // One endpoint, or several separated by commas, as a string.
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(|e| e.trim().to_owned())
                .filter(|e| !e.is_empty())
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

/// The endpoint the gateway says served the request, when it says.
pub fn served(metadata: Option<&Metadata>) -> Option<String> {
    match field(metadata, LB_NAMESPACE, SERVED)? {
        Kind::StringValue(s) => Some(s.trim().to_owned()),
        _ => None,
    }
}

fn set(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_owned(),
            raw_value: value.to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn wrap(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// Request headers the pick sets or removes besides the destination.
#[derive(Clone, Debug, Default)]
pub struct PickedHeaders {
    pub set: Vec<(&'static str, Vec<u8>)>,
    pub remove: Vec<&'static str>,
}

/// The answer to the request's headers once the endpoints are picked: the endpoints in the
/// destination header and, the same value, in the `envoy.lb` dynamic metadata; and `headers`.
pub fn picked(
    endpoints: &str,
    body_len: Option<usize>,
    headers: PickedHeaders,
) -> ProcessingResponse {
    let mut set_headers = vec![set(DESTINATION, endpoints.as_bytes())];
    if let Some(len) = body_len {
        set_headers.push(set("content-length", len.to_string().as_bytes()));
    }
    for (name, value) in &headers.set {
        set_headers.push(set(name, value));
    }
    let remove_headers = headers.remove.iter().map(|h| h.to_string()).collect();
    let lb = Struct {
        fields: [(
            DESTINATION.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_owned())),
            },
        )]
        .into(),
    };
    ProcessingResponse {
        dynamic_metadata: Some(Struct {
            fields: [(
                LB_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(lb)),
                },
            )]
            .into(),
        }),
        ..wrap(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers,
                        remove_headers,
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            },
        ))
    }
}

/// Which body a body answer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// A body piece handed back unchanged in full-duplex streaming (the gateway forwards only
/// what the picker sends back).
pub fn streamed_body(
    direction: Direction,
    body: Vec<u8>,
    end_of_stream: bool,
) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    body_answer(direction, common)
}

/// A body left as it is (buffered mode: the gateway keeps its own copy).
pub fn body_unchanged(direction: Direction) -> ProcessingResponse {
    body_answer(direction, CommonResponse::default())
}

fn body_answer(direction: Direction, common: CommonResponse) -> ProcessingResponse {
    let answer = BodyResponse {
        response: Some(common),
    };
    wrap(match direction {
        Direction::Request => processing_response::Response::RequestBody(answer),
        Direction::Response => processing_response::Response::ResponseBody(answer),
    })
}

/// A request body handed back in pieces, the last one ending the stream (a body that fits in
/// one piece, the usual case, is moved, not copied).
pub fn streamed_request_body(body: bytes::Bytes) -> Vec<ProcessingResponse> {
    if body.len() <= BODY_CHUNK {
        return vec![streamed_body(Direction::Request, body.to_vec(), true)];
    }
    let pieces = body.chunks(BODY_CHUNK).count();
    body.chunks(BODY_CHUNK)
        .enumerate()
        .map(|(i, piece)| streamed_body(Direction::Request, piece.to_vec(), i + 1 == pieces))
        .collect()
}

/// The response's headers pass unchanged.
pub fn response_headers_unchanged() -> ProcessingResponse {
    wrap(processing_response::Response::ResponseHeaders(
        HeadersResponse {
            response: Some(CommonResponse::default()),
        },
    ))
}

/// Trailers pass unchanged.
pub fn trailers_unchanged(direction: Direction) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    wrap(match direction {
        Direction::Request => processing_response::Response::RequestTrailers(answer),
        Direction::Response => processing_response::Response::ResponseTrailers(answer),
    })
}

/// Whether an answer is the picker's own response to the client.
pub fn is_immediate(answer: &ProcessingResponse) -> bool {
    matches!(
        answer.response,
        Some(processing_response::Response::ImmediateResponse(_))
    )
}

/// The gateway answers the client with this response instead of sending the request on: the
/// same status, headers (`retry-after`, `content-type`) and OpenAI-shaped body as `serve`'s.
pub async fn immediate(response: axum::response::Response) -> ProcessingResponse {
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let set_headers = parts
        .headers
        .iter()
        .filter(|(name, _)| *name != axum::http::header::CONTENT_LENGTH)
        .map(|(name, value)| set(name.as_str(), value.as_bytes()))
        .collect();
    wrap(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(parts.status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..Default::default()
            }),
            body,
            ..Default::default()
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(namespace: &str, key: &str, kind: Kind) -> Metadata {
        Metadata {
            filter_metadata: [(
                namespace.to_owned(),
                Struct {
                    fields: [(key.to_owned(), Value { kind: Some(kind) })].into(),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_reads_as_a_list_or_a_string() {
        let list = Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
            values: ["10.0.0.1:8000", "10.0.0.2:8000"]
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).into())),
                })
                .collect(),
        });
        assert_eq!(
            subset(Some(&metadata(SUBSET_NAMESPACE, SUBSET, list))),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        let string = Kind::StringValue("10.0.0.1:8000, 10.0.0.3:8000".into());
        assert_eq!(
            subset(Some(&metadata(SUBSET_NAMESPACE, SUBSET, string))).map(|s| s.len()),
            Some(2)
        );
        // Set but not a list: nothing is eligible (the protocol's empty subset).
        assert_eq!(
            subset(Some(&metadata(
                SUBSET_NAMESPACE,
                SUBSET,
                Kind::BoolValue(true)
            ))),
            Some(vec![])
        );
        assert_eq!(subset(None), None);
        assert_eq!(
            served(Some(&metadata(
                LB_NAMESPACE,
                SERVED,
                Kind::StringValue("1.2.3.4:80".into())
            ))),
            Some("1.2.3.4:80".to_owned())
        );
    }

    #[test]
    fn a_body_goes_back_in_pieces_and_only_the_last_ends_it() {
        let body = vec![7u8; BODY_CHUNK * 2 + 5];
        let pieces = streamed_request_body(body.clone().into());
        assert_eq!(pieces.len(), 3);
        let mut back = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(b)) = &p.response else {
                panic!("not a request body answer");
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) = b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            else {
                panic!("not streamed");
            };
            assert_eq!(s.end_of_stream, i == 2);
            back.extend_from_slice(&s.body);
        }
        assert_eq!(back, body);
    }
}
