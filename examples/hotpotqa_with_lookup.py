"""Subclass the built-in HotpotQA environment and give the model a second tool: open a paragraph by title."""

from agentrl import Episode, tool
from environments.hotpotqa_search import HotpotQASearchEnv


class HotpotQAWithLookup(HotpotQASearchEnv):
    @tool
    def open_page(self, title: str, episode: Episode) -> str:
        """Return the whole paragraph whose title matches exactly.

        Args:
            title: The exact title, as shown in a search result.
        """
        index = self.index_for(episode.sample)
        if title not in index.titles:
            raise ValueError(f"no paragraph titled {title!r}; search first and copy a title")
        return index.texts[index.titles.index(title)]
