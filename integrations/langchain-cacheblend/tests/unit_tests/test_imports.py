from langchain_cacheblend import __all__

EXPECTED_ALL = ["CacheBlendContextOverflowError", "CacheBlendRetriever", "ChatCacheBlend", "cacheblend_retriever_tool"]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)
