"""kvserve.paging"""
